"""scripts/quality_report.py: rows for any registered passes, and a section that leaves others alone."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from mmsdk import VQAExample
from mmsdk.profiling import ProfileSample
from mmsdk.testing import sample_image

SCRIPT = Path(__file__).parents[1] / "scripts" / "quality_report.py"


def _script():
    spec = importlib.util.spec_from_file_location("quality_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being created
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(importlib.util.find_spec("mmsdk.evaluation") is None, reason="no mmsdk.evaluation")
def test_rows_and_markdown_for_registered_passes(session):
    report = _script()
    configs = report.configurations(session)
    assert configs[0] == () and ("qkv-fuse",) in configs
    assert all(all(report.step_name(step) in session.passes for step in c) for c in configs)  # unregistered left out
    examples = [VQAExample(sample_image(i, 30), "is it even ?", "yes") for i in range(2)]
    sample = ProfileSample(sample_image(0, 30), "is it even ?", 2)
    rows = [report.measure(session, "tiny:llava", passes, examples, sample) for passes in [(), ("qkv-fuse",)]]
    rows.append(report.measure(session, "tiny:llava", ("no-such-pass",), examples, sample))
    assert rows[0].count == 2 and rows[0].weights_bytes == rows[1].weights_bytes > 0
    assert "Unknown pass 'no-such-pass'" in rows[2].skipped
    text = report.render(rows, command="python scripts/quality_report.py --limit 2", limit=2)
    assert text.startswith(report.BEGIN) and text.rstrip().endswith(report.END)
    assert "| qkv-fuse |" in text and "| no-such-pass | n/a |" in text and "### tiny:llava" in text


def test_section_replaces_only_itself(tmp_path):
    report = _script()
    doc = tmp_path / "quality.md"
    doc.write_text("# Quality\n\n## int4-kv (written by another script)\nkeep me\n")
    report.write_section(doc, f"{report.BEGIN}\nfirst\n{report.END}\n")
    report.write_section(doc, f"{report.BEGIN}\nsecond\n{report.END}\n")
    text = doc.read_text()
    assert "keep me" in text and "second" in text and "first" not in text and text.count(report.BEGIN) == 1


def test_config_steps_and_resume(session, tmp_path):
    report = _script()
    config = report.step_config(session, "qkv-fuse(vision_tower=true)")
    assert config.vision_tower is True and report.step_name("qkv-fuse(vision_tower=true)") == "qkv-fuse"
    done = report.Row("tiny:llava", ("qkv-fuse",), 0.5, 2, 10, 1, 20)
    (tmp_path / "rows.json").write_text(json.dumps([dataclasses.asdict(done)]))
    assert report._load_rows(tmp_path / "rows.json") == [done]
