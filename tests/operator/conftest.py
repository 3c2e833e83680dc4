"""Fixtures of the operator tests."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

# pytest runs in importlib mode, so test modules reach their shared helpers through this folder on sys.path.
sys.path.insert(0, str(Path(__file__).parent))

from isvc_helpers import REPO, load_yaml

from npuserve.operator.crd import CRD_FILE


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return load_yaml(REPO / CRD_FILE)


@pytest.fixture(scope="session")
def root_schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema
