"""Shared fixtures: fresh sessions, tiny models, and a guard against files left in the working folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["mmsdk.testing.fixtures"]


@pytest.fixture(autouse=True, scope="session")
def _no_files_left_in_cwd() -> None:
    """Fail the run if a test wrote into the current folder instead of tmp_path."""
    before = set(Path.cwd().iterdir())
    yield
    created = sorted(str(p.name) for p in set(Path.cwd().iterdir()) - before)
    assert not created, f"tests left files in {os.getcwd()}: {created}"
