"""Shared fixtures: fresh sessions, tiny models, a guard against files left in the working folder, torch's threads
shared among pytest-xdist's workers, and the slow interpreter checks scheduled first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["mmsdk.testing.fixtures"]


def pytest_configure(config: pytest.Config) -> None:
    """No tuning choices kept between processes; under pytest-xdist, share the cores among the workers: torch
    defaults to a thread per core in every worker, so two workers on two cores would run four threads."""
    # every test process tunes on its own: choices an earlier run kept on disk (mmsdk.kernels.tuning_cache) would
    # skip the timing that tuner tests check; the tests of that file name their own with monkeypatch
    os.environ["MMSDK_TUNING_CACHE"] = "0"
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the Triton-interpreter checks first. Each runs kernel tests in a subprocess for up to four minutes, so
    they must start at once on both workers, with the short tests filling in around them, rather than one starting
    late and leaving the other worker idle at the end. pytest-xdist's default deals each worker a block of
    consecutive tests at the start (a quarter of its share), which would give one worker all of these; the README's
    ``--maxschedchunk 1`` makes it deal two tests to each worker and then one at a time."""
    items.sort(key=lambda item: not getattr(item, "originalname", item.name).endswith("under_the_interpreter"))


@pytest.fixture(autouse=True, scope="session")
def _no_files_left_in_cwd() -> None:
    """Fail the run if a test wrote into the current folder instead of tmp_path."""
    before = set(Path.cwd().iterdir())
    yield
    created = sorted(str(p.name) for p in set(Path.cwd().iterdir()) - before)
    assert not created, f"tests left files in {os.getcwd()}: {created}"
