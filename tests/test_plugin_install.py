"""The example plugin package, really installed with pip into an isolated folder, is found by `mmsdk plugins`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_pip_installed_plugin_is_listed_and_can_be_switched_off(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
         str(ROOT / "examples" / "plugin_package")],
        check=True, capture_output=True, text=True,
    )

    def plugin_names(**env: str) -> set[str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("MMSDK_")}
        run_env = {**base, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)]), **env}
        out = subprocess.run([sys.executable, "-m", "mmsdk", "plugins", "--json"], env=run_env,
                             check=True, capture_output=True, text=True, cwd=tmp_path)
        return {p["name"] for p in json.loads(out.stdout)}

    assert "example" in plugin_names()
    assert "example" not in plugin_names(MMSDK_DISABLE_PLUGINS="example")
    assert "example" not in plugin_names(MMSDK_DISABLE_PLUGIN_AUTOLOAD="1")
