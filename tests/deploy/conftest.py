"""Fixtures of the chart and Dockerfile tests: a Helm binary (found or installed once, see helmtool.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# pytest runs in importlib mode: the helpers next to the tests are imported through this folder.
sys.path.insert(0, str(Path(__file__).parent))

import helmtool


@pytest.fixture(scope="session")
def helm() -> Path:
    return helmtool.ensure_helm()
