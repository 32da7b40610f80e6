"""pytest fixtures for mmsdk and plugin test suites: ``pytest_plugins = ["mmsdk.testing.fixtures"]``."""

from __future__ import annotations

from typing import Callable

import pytest

from mmsdk.core.session import Session
from mmsdk.core.sources import LoadedModel


@pytest.fixture
def session() -> Session:
    """A fresh session with the built-ins only (installed plugins are not auto-loaded)."""
    return Session.create(autoload=False, disabled=())


@pytest.fixture
def tiny(session: Session) -> Callable[[str], LoadedModel]:
    """Build a tiny model by name: ``tiny("tiny:llava")`` -> LoadedModel(model, processor)."""

    def build(name: str) -> LoadedModel:
        return session.models.get(name).build()

    return build
