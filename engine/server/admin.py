"""Live schedule changes: `PUT /admin/schedule` (bearer token) and a watch on the config file.

Both go through `apply_schedule`: the new ScheduleConfig is validated against the whole running config (cross-field
rules included), handed to the step thread, and the call returns once the scheduler runs it (so `/info` shows it
at once); anything invalid is refused and the running config is kept. Which fields apply live is the contract's
table (`engine_contract.HOT_SCHEDULE_FIELDS`); the others (cacheBlockSize sizes the KV pool, and the
ModelDeployConfig fields) need a restart: the operator rolls the pods for them. maxBatchSize is live up to
`npuserve.maxBatchSizeLimit` (the start-up maxBatchSize without it), the batch the KV pool and the decode graphs were
sized for; past it the change is refused.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Header

from npuserve.engine.server.errors import APIError
from npuserve.engine.server.json_body import StrictJSONRoute
from npuserve.engine.server.protocol import ScheduleUpdate
from npuserve.engine.server.state import ServerState, State
from npuserve.engine_contract import ADMIN_SCHEDULE_PATH, ADMIN_TOKEN_ENV, RESTART_SCHEDULE_FIELDS
from npuserve.mindie_config import MindIEConfig, MindIEConfigError

log = logging.getLogger(__name__)
router = APIRouter(route_class=StrictJSONRoute)

# Besides the table's restart-only fields, MindIE's template names select the step template (only Standard runs).
RESTART_ONLY_FIELDS = (*sorted(RESTART_SCHEDULE_FIELDS), "templateType", "templateName")
APPLY_TIMEOUT_SECONDS = 30.0
_SCHEDULE_FIELD_NAMED = re.compile(r"ScheduleConfig\.(\w+)")


async def apply_schedule(state: ServerState, changes: dict[str, Any]) -> dict[str, Any]:
    """Validates ScheduleConfig changes and hot-applies them; returns the schedule the scheduler then runs.
    Raises MindIEConfigError (invalid) or TimeoutError (the step thread did not take it)."""
    engine = state.engine.engine
    new_config = engine.config.with_schedule(**changes)
    engine.config = new_config
    live = await asyncio.wait_for(asyncio.wrap_future(state.engine.update_schedule(new_config.schedule)),
                                  APPLY_TIMEOUT_SECONDS)
    log.info("schedule updated: %s", changes)
    return live.model_dump(mode="json")


def _authorize(state: ServerState, authorization: str | None) -> None:
    if not state.admin_token:
        raise APIError(403, f"the admin API is disabled: set {ADMIN_TOKEN_ENV} to enable it")
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), state.admin_token.encode()):
        raise APIError(401, "a valid bearer token is required", headers={"WWW-Authenticate": "Bearer"})


@router.put(ADMIN_SCHEDULE_PATH)
async def put_schedule(body: ScheduleUpdate, state: State,
                       authorization: Annotated[str | None, Header()] = None) -> dict[str, Any]:
    _authorize(state, authorization)
    changes = body.model_dump(exclude_none=True)
    if not changes:
        raise APIError(422, "no ScheduleConfig field given", param="body")
    try:
        schedule = await apply_schedule(state, changes)
    except MindIEConfigError as e:
        raise APIError(422, str(e), param=_first_field(str(e))) from e
    except TimeoutError as e:
        raise APIError(503, "the engine's step loop did not take the schedule in time; retry") from e
    return {"schedule": schedule}


def _first_field(message: str) -> str | None:
    for line in message.splitlines()[1:]:
        path, _, text = line.strip().partition(":")
        if path == "(root)":  # a rule across sections (npuserve.maxBatchSizeLimit): the ScheduleConfig field it names
            named = _SCHEDULE_FIELD_NAMED.search(text)
            return named.group(1) if named else None
        if path:
            return path.rsplit(".", 1)[-1]
    return None


class ConfigWatcher:
    """Polls the config file (a ConfigMap volume swaps a symlink, so inotify on the file misses it) and hot-applies
    ScheduleConfig changes."""

    def __init__(self, state: ServerState, path: Path, interval: float = 1.0) -> None:
        self.state = state
        self.path = path
        self.interval = interval
        self._seen = self._fingerprint()
        self.applied = 0
        self.rejected = 0

    def _fingerprint(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    async def check(self) -> None:
        fingerprint = self._fingerprint()
        if fingerprint is None or fingerprint == self._seen:
            return
        self._seen = fingerprint
        try:
            new = MindIEConfig.load(self.path)
        except (MindIEConfigError, OSError) as e:
            self.rejected += 1
            log.error("config file %s changed but is invalid; keeping the running config:\n%s", self.path, e)
            return
        live = self.state.engine.engine.config
        new_schedule, live_schedule = new.schedule.model_dump(), live.schedule.model_dump()
        changes = {k: v for k, v in new_schedule.items()
                   if v != live_schedule.get(k) and k not in RESTART_ONLY_FIELDS}
        restart_only = [k for k in RESTART_ONLY_FIELDS if new_schedule.get(k) != live_schedule.get(k)]
        if new.model.model_dump() != live.model.model_dump() or new.deploy.maxSeqLen != live.deploy.maxSeqLen:
            restart_only.append("ModelDeployConfig")
        if restart_only:
            log.warning("config file changes to %s need a restart; they are not applied", ", ".join(restart_only))
        if changes:
            try:
                await apply_schedule(self.state, changes)
                self.applied += 1
            except MindIEConfigError as e:
                self.rejected += 1
                log.error("config file %s: schedule refused; keeping the running config:\n%s", self.path, e)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except Exception:  # the watcher must never take the server down
                log.exception("config watch failed")
