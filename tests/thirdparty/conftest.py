"""`make conformance` sets NPUSERVE_CONFORMANCE=1; without it the tests marked `conformance` (vLLM's own benchmark,
a multi-GB install) are skipped, so `make test` never installs vLLM."""

from __future__ import annotations

import os

import pytest

CONFORMANCE_ENV = "NPUSERVE_CONFORMANCE"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get(CONFORMANCE_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"vLLM's benchmark runs in `make conformance` ({CONFORMANCE_ENV}=1)")
    for item in items:
        if item.get_closest_marker("conformance"):
            item.add_marker(skip)
