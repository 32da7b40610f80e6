"""The examples run as written on tiny models, and the CLI verbs work end to end."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from mmsdk.cli import main as cli

ROOT = Path(__file__).parents[1]
EXAMPLES = [
    ("llava/optimize_llava.py", "tiny:llava"),
    ("qwen_vl/optimize_qwen_vl.py", "tiny:qwen2.5-vl"),
    ("flamingo/optimize_flamingo.py", "tiny:mllama"),
]


@pytest.mark.parametrize("script, model", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_example_runs(script, model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", [script, model, "--out", str(out)])
    runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
    printed = capsys.readouterr().out
    assert "answer:" in printed and "unoptimized" in printed and (out / "manifest.json").is_file()


def test_cli_plugins_lists_builtins_with_provenance(capsys):
    assert cli(["plugins", "--json"]) == 0
    data = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert data["mmsdk.qkv_fuse"]["builtin"] is True
    assert {"kind": "attention pass", "name": "qkv-fuse"} in data["mmsdk.qkv_fuse"]["contributes"]
    assert cli(["plugins"]) == 0 and "qkv-fuse" in capsys.readouterr().out


def test_cli_optimize_exports_and_reports(tmp_path, capsys):
    out = tmp_path / "llava"
    assert cli(["optimize", "tiny:llava", "--apply", "qkv-fuse", "--export", "torch", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [p["name"] for p in manifest["passes"]] == ["qkv-fuse"] and manifest["backend"] == "torch"
    assert "+ qkv-fuse" in capsys.readouterr().out


def test_cli_errors_print_the_fix_and_exit_2(tmp_path, capsys):
    code = cli(["optimize", "tiny:llava", "--apply", "qkv_fuse", "--export", "torch", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and "Did you mean 'qkv-fuse'" in err and not (tmp_path / "x").exists()
    assert cli(["optimize", "tiny:lava", "--export", "torch", "--out", str(tmp_path / "y")]) == 2
    assert "Did you mean 'tiny:llava'" in capsys.readouterr().err


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(line for line in readme.splitlines() if "pytest" in line and line.startswith("python3"))
    assert test_command in ci


def test_demo_keeps_accuracy_and_exports(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli(["demo", "--out", str(out), "--eval-count", "40"]) == 0
    printed = capsys.readouterr().out
    line = next(row for row in printed.splitlines() if row.startswith("held-out accuracy"))
    before, after = (float(part.split()[-1].rstrip("%,")) for part in line.split(": ", 1)[1].split(", "))
    # The demo's passes are chosen to keep accuracy: measured 86.5% -> 86.5% on 200 questions.
    assert after >= before - 5.0, line
    manifest = json.loads((out / "manifest.json").read_text())
    assert [p["name"] for p in manifest["passes"]][:2] == ["qkv-fuse", "vit-prune"]
    assert "KV cache" in printed and "memory of one answer" in printed
