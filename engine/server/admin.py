"""Live schedule changes: `PUT /admin/schedule` (bearer token) and a watch on the config file.

Both go through `apply_schedule`: the new ScheduleConfig is validated against the whole running config (cross-field
rules included), handed to the step thread, and the call returns once the scheduler runs it (so `/info` shows it
at once); anything invalid is refused and the running config is kept. A schedule carries a generation
(`scheduleGeneration`, the operator's count of the schedules it decided): one that is not newer than the generation
the engine runs is not applied, from either path (`generation_refusal`), so a stale writer (a ConfigMap the kubelet
delivers after a newer PUT) never replaces a trial's schedule in the middle of its window. Which fields apply live
is the contract's table (`engine_contract.HOT_SCHEDULE_FIELDS`); the others (cacheBlockSize sizes the KV pool, and
the ModelDeployConfig fields) need a restart: the operator rolls the pods for them. maxBatchSize is live up to
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
from npuserve.engine_contract import (
    ADMIN_SCHEDULE_PATH,
    ADMIN_TOKEN_ENV,
    RESTART_SCHEDULE_FIELDS,
    SCHEDULE_GENERATION_KEY,
)
from npuserve.mindie_config import MindIEConfig, MindIEConfigError

log = logging.getLogger(__name__)
router = APIRouter(route_class=StrictJSONRoute)

# Besides the table's restart-only fields, MindIE's template names select the step template (only Standard runs).
RESTART_ONLY_FIELDS = (*sorted(RESTART_SCHEDULE_FIELDS), "templateType", "templateName")
APPLY_TIMEOUT_SECONDS = 30.0
_SCHEDULE_FIELD_NAMED = re.compile(r"ScheduleConfig\.(\w+)")


class StaleSchedule(Exception):
    """A schedule whose generation is not newer than the one the engine runs; not applied."""


def generation_refusal(running: int | None, offered: int | None) -> str | None:
    """Why a schedule of generation `offered` must not replace the running one of generation `running`, or None
    when it may. Without generations on either side (a hand-written config) any schedule applies; once the engine
    runs a generation, only a newer one does (an ungenerated one is a writer that does not know the order)."""
    if offered is None:
        if running is None:
            return None
        return f"the engine runs {SCHEDULE_GENERATION_KEY} {running}; a schedule without one is not applied"
    if running is not None and offered <= running:
        return f"{SCHEDULE_GENERATION_KEY} {offered} is not newer than the {running} the engine runs"
    return None


async def apply_schedule(state: ServerState, changes: dict[str, Any], generation: int | None = None,
                         ) -> dict[str, Any]:
    """Validates ScheduleConfig changes of `generation` and hot-applies them; returns the schedule the scheduler
    then runs. Raises StaleSchedule (not newer than the running generation), MindIEConfigError (invalid) or
    TimeoutError (the step thread did not take it)."""
    engine = state.engine.engine
    # Checked and set with no await between: the PUT handler and the config watch share this event loop.
    refusal = generation_refusal(engine.config.extensions.scheduleGeneration, generation)
    if refusal is not None:
        raise StaleSchedule(refusal)
    new_config = engine.config.with_schedule(**changes)
    if generation is not None:
        new_config = new_config.with_schedule_generation(generation)
    engine.config = new_config
    live = await asyncio.wait_for(asyncio.wrap_future(state.engine.update_schedule(new_config.schedule)),
                                  APPLY_TIMEOUT_SECONDS)
    state.engine.metrics.set_schedule_generation(generation)
    log.info("schedule updated (%s %s): %s", SCHEDULE_GENERATION_KEY, generation, changes)
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
    changes = body.model_dump(exclude_none=True, exclude={SCHEDULE_GENERATION_KEY})
    if not changes:
        raise APIError(422, "no ScheduleConfig field given", param="body")
    try:
        schedule = await apply_schedule(state, changes, body.scheduleGeneration)
    except StaleSchedule as e:
        log.warning("PUT %s refused: %s", ADMIN_SCHEDULE_PATH, e)
        raise APIError(409, str(e), param=SCHEDULE_GENERATION_KEY) from e
    except MindIEConfigError as e:
        raise APIError(422, str(e), param=_first_field(str(e))) from e
    except TimeoutError as e:
        raise APIError(503, "the engine's step loop did not take the schedule in time; retry") from e
    return {"schedule": schedule, SCHEDULE_GENERATION_KEY: body.scheduleGeneration}


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
        self.stale = 0  # files whose schedule generation was not newer than the running one

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
        generation = new.extensions.scheduleGeneration
        if changes or generation != live.extensions.scheduleGeneration:
            try:
                await apply_schedule(self.state, changes, generation)
                self.applied += 1
            except StaleSchedule as e:
                self.stale += 1
                log.warning("config file %s: schedule not applied: %s", self.path, e)
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
