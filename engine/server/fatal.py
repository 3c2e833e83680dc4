"""The engine's last words: the termination message Kubernetes shows, and an exit that no thread can hold up.

The message goes to the container's termination-message path (`engine_contract.TERMINATION_LOG_ENV`, else the
kubelet's default, written only where the kubelet made it), whence the kubelet puts it in the pod's status and the
operator in the InferenceService's Ready condition (docs/operator.md).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from npuserve.engine_contract import DEFAULT_TERMINATION_LOG, TERMINATION_LOG_ENV

log = logging.getLogger(__name__)

EXIT_CODE = 1
# The kubelet keeps at most 4096 bytes of a termination message.
_MESSAGE_LIMIT = 4096


def termination_log_path() -> Path | None:
    """Where the termination message goes: the variable's path, else the kubelet's default if it exists."""
    configured = os.environ.get(TERMINATION_LOG_ENV)
    if configured:
        return Path(configured)
    default = Path(DEFAULT_TERMINATION_LOG)
    return default if default.exists() else None


def write_termination_message(message: str) -> None:
    """Replaces the termination message; a path that cannot be written is logged, never raised."""
    path = termination_log_path()
    if path is None:
        return
    try:
        path.write_text(message.encode()[:_MESSAGE_LIMIT].decode(errors="ignore") + "\n")
    except OSError as e:
        log.warning("could not write the termination message to %s: %s", path, e)


def hard_exit(code: int) -> None:
    """Ends the process now, from any thread (the step thread may be stuck in a collective, where a normal exit
    would wait for it)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
