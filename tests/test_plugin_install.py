"""The example plugin package, really installed with pip into an isolated folder, is found by `mmsdk plugins`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _setuptools_builds_wheels() -> bool:
    """Whether this interpreter's setuptools builds wheels by itself (70.1 and later; before, it needed the wheel
    package), so the example package builds without an index (a machine with no network; torch depends on
    setuptools, so the README's install has it)."""
    try:
        from importlib.metadata import version

        major, minor = (int(part) for part in version("setuptools").split(".")[:2])
    except Exception:  # not installed, or a version string this does not read: pip's isolated build
        return False
    return (major, minor) >= (70, 1)


@pytest.mark.slow
def test_pip_installed_plugin_is_listed_and_can_be_switched_off(tmp_path):
    target = tmp_path / "site"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
               str(ROOT / "examples" / "plugin_package")]
    if _setuptools_builds_wheels():  # build with it: pip's isolated build fetches setuptools from an index
        command.append("--no-build-isolation")
    built = subprocess.run(command, capture_output=True, text=True)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]

    def plugin_names(**env: str) -> set[str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("MMSDK_")}
        # the folder first, the interpreter's own path after it (where mmsdk's dependencies may come from)
        path = [str(target), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        run_env = {**base, "PYTHONPATH": os.pathsep.join(path), **env}
        out = subprocess.run([sys.executable, "-m", "mmsdk", "plugins", "--json"], env=run_env,
                             capture_output=True, text=True, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        return {p["name"] for p in json.loads(out.stdout)}

    assert "example" in plugin_names()
    assert "example" not in plugin_names(MMSDK_DISABLE_PLUGINS="example")
    assert "example" not in plugin_names(MMSDK_DISABLE_PLUGIN_AUTOLOAD="1")
