"""Shared fixtures. Model folders are written once per session through the real `create-dummy` path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# the test module whose presence in a run means the run reads the quantizers' checkpoints (a whole-suite run does)
_QUANT_TOOLS_TESTS = "test_quant_tools.py"


def pytest_collection_finish(session: pytest.Session) -> None:
    """A run that includes the W8A8 checkpoint tests starts building the quantizers' virtualenvs and checkpoints in the
    background at once (tests/quant_checkpoints.py `prewarm`): minutes of downloads on a fresh machine, overlapped
    with the tests that come first. NPUSERVE_PREWARM=0 turns it off."""
    if os.environ.get("NPUSERVE_PREWARM", "1") == "0" or session.config.option.collectonly:
        return
    if any(item.path.name == _QUANT_TOOLS_TESTS for item in session.items):
        from tests.quant_checkpoints import prewarm

        prewarm()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from npuserve.catalog.models import get_model_preset
    from npuserve.engine.model.dummy import write_dummy_model

    return write_dummy_model(get_model_preset("tiny"), tmp_path_factory.mktemp("tiny"), seed=0)
