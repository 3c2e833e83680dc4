"""Shared fixtures. Model folders are written once per session through the real `create-dummy` path."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# the test module whose presence in a run means the run reads the quantizers' checkpoints (a whole-suite run does)
_QUANT_TOOLS_TESTS = "test_quant_tools.py"


def pytest_collection_finish(session: pytest.Session) -> None:
    """What a run needs from the network or a compiler starts at once, in the background at the lowest priority, so
    it overlaps the tests that come first (each waits on its file locks and finds the work done):
    - the W8A8 checkpoint tests: the quantizers' virtualenvs and checkpoints (tests/quant_checkpoints.py `prewarm`),
      minutes of downloads on a fresh machine;
    - the third-party clients' tests: aiperf's, guidellm's and lm-eval's virtualenv (tests/thirdparty/tools_venv.py,
      about 3 minutes and 7 GB the first time);
    - the cluster's tests (run last: `pytest_collection_modifyitems`): Helm, then the Kubernetes, Prometheus and LWS
      binaries, about 17 minutes of Go builds on 2 cores the first time (`e2e/cluster/cluster.py build`; a no-op
      once cached).
    All of them pause while a test marked `wallclock` runs (its figures are timed against a tolerance).
    NPUSERVE_PREWARM=0 turns them off."""
    if os.environ.get("NPUSERVE_PREWARM", "1") == "0" or session.config.option.collectonly:
        return
    if any(item.path.name == _QUANT_TOOLS_TESTS for item in session.items):
        from tests.quant_checkpoints import prewarm

        if (proc := prewarm()) is not None:
            _BACKGROUND.append(proc)
    from tests.thirdparty.tools_venv import in_background

    if any(item.path.name == _CLIENTS_TESTS and not item.get_closest_marker("skip") for item in session.items):
        _BACKGROUND.append(in_background([sys.executable, "-P", str(_TOOLS_VENV), "clients"], "clients-prewarm.log"))
    if any("e2e" in item.keywords and not item.get_closest_marker("skip") for item in session.items):
        # (NPUSERVE_SKIP_E2E marks them skipped: tests/e2e/conftest.py)
        _BACKGROUND.append(in_background([sys.executable, "-P", str(_CLUSTER_CLI), "build"], "cluster-prewarm.log"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """What needs the cluster's binaries runs last, in its own order: the Helm chart's tests (helm), then the e2e
    tests (the whole cluster). On a fresh machine those binaries build in the background meanwhile
    (`pytest_collection_finish`), overlapping the rest of the suite."""
    def stage(item: pytest.Item) -> int:
        if "e2e" in item.keywords:
            return 2
        return 1 if _DEPLOY_TESTS in item.path.parents else 0

    items.sort(key=stage)  # stable: each stage keeps its collection order


_DEPLOY_TESTS = Path(__file__).resolve().parent / "deploy"


# The background builds of this run (each the leader of its own process group).
_BACKGROUND: list[subprocess.Popen[bytes]] = []


def _signal_background(sig: signal.Signals) -> None:
    for proc in _BACKGROUND:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A wall-clock test's fixtures and body run with the background builds stopped (SIGSTOP to their groups): a Go
    compile beside a 5% TPOT tolerance on 2 cores is a neighbour the test cannot tell from a slow engine."""
    if item.get_closest_marker("wallclock"):
        _signal_background(signal.SIGSTOP)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if item.get_closest_marker("wallclock"):
        _signal_background(signal.SIGCONT)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _signal_background(signal.SIGCONT)  # never leave a build stopped (an interrupted run included)


_CLUSTER_CLI = Path(__file__).resolve().parents[1] / "e2e" / "cluster" / "cluster.py"
_TOOLS_VENV = Path(__file__).resolve().parent / "thirdparty" / "tools_venv.py"
_CLIENTS_TESTS = "test_clients.py"  # the module whose tests run the clients' virtualenv


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from npuserve.catalog.models import get_model_preset
    from npuserve.engine.model.dummy import write_dummy_model

    return write_dummy_model(get_model_preset("tiny"), tmp_path_factory.mktemp("tiny"), seed=0)
