"""Shared fixtures. Model folders are written once per session through the real `create-dummy` path."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from npuserve.catalog.models import get_model_preset
    from npuserve.engine.model.dummy import write_dummy_model

    return write_dummy_model(get_model_preset("tiny"), tmp_path_factory.mktemp("tiny"), seed=0)
