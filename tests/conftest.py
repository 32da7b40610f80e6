"""Shared fixtures: fresh sessions, tiny models, a guard against files left in the working folder, and torch's
threads shared among pytest-xdist's workers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["mmsdk.testing.fixtures"]


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, share the cores among the workers: torch defaults to a thread per core in every worker,
    so two workers on two cores would run four threads."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.fixture(autouse=True, scope="session")
def _no_files_left_in_cwd() -> None:
    """Fail the run if a test wrote into the current folder instead of tmp_path."""
    before = set(Path.cwd().iterdir())
    yield
    created = sorted(str(p.name) for p in set(Path.cwd().iterdir()) - before)
    assert not created, f"tests left files in {os.getcwd()}: {created}"
