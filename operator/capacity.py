"""Capacity from measurement (`spec.capacity`): after the tuning verdict, how many concurrent users one instance holds
under the SLO, and the replicas that hold the target. Part of the autotune state machine (`autotune.py` drives it
through `CapacityHost`); pure.

- `benchmark`: probes (load-generator Jobs) at rising client concurrency from the best trial's load, a known pass:
  doubling, then bisection to within CAPACITY_TOLERANCE; each probe judged by the one judge.
- `online`: derived from the chosen schedule's windows: the mean requests in flight per pod (Little's law).
- without TTFT/TPOT bounds: the best trial's client concurrency.

Capacity follows the verdict: nothing is measured unless the verdict's own evidence met the SLO.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

from npuserve.planning.api import (
    CapacityProbe,
    CapacityStatus,
    InferenceService,
    Plan,
    TrialInProgress,
    TrialMetrics,
    TuningStatus,
)
from npuserve.planning.problem import TunedSchedule, TuningProblem

from .autotune_types import Actions, Observation, Status

CAPACITY_LIMIT_FACTOR = 2  # the capacity search goes at most this many times the tuned maxBatchSize
CAPACITY_TOLERANCE = 0.1  # the capacity search stops when the bracket is this narrow (relative)


class CapacityHost(Protocol):
    """What the capacity part needs of one look of the autotune loop."""

    isvc: InferenceService
    plan: Plan
    obs: Observation
    status: Status
    tuning: TuningStatus
    problem: TuningProblem
    key: str
    now: str
    actions: Actions

    def event(self, kind: Literal["Normal", "Warning"], reason: str, message: str) -> None: ...

    def pods_ready(self) -> bool: ...

    def open_probe(self, number: int, concurrency: int) -> str: ...


def advance(host: CapacityHost) -> bool:
    """Measure or derive the per-instance concurrency and scale to the target; True while a probe runs."""
    spec = host.isvc.spec.capacity
    if spec is None or host.tuning.phase == "Running":
        return False
    cap = CapacityStatus.model_validate(host.status["capacity"]) if host.status.get("capacity") else None
    if cap is not None and cap.problem == host.key and cap.phase in ("Measured", "Failed"):
        return False
    static = host.plan.concurrencyPerReplica
    if cap is None or cap.problem != host.key:
        cap = CapacityStatus(problem=host.key, targetConcurrentUsers=spec.targetConcurrentUsers,
                             staticConcurrencyPerReplica=static,
                             staticReplicas=math.ceil(spec.targetConcurrentUsers / static))
    verdict = host.tuning.verdict
    if verdict is None or not verdict.sloMet or verdict.maxBatchSize is None or verdict.pooled is None:
        cap.phase, cap.message = "Failed", ("no tuned schedule met the SLO, so nothing was measured; replicas "
                                            "stay as planned (status.plan.replicas)")
        _write(host, cap)
        return False
    batch = verdict.maxBatchSize
    measured: int | None = None
    if host.isvc.spec.autotune.mode == "online":
        per_pod = verdict.pooled.inFlightPerPod
        if per_pod is None or per_pod < 1:
            cap.phase, cap.message = "Failed", ("the chosen schedule's windows had under one request in flight per "
                                                "pod: too little traffic to derive a capacity from")
        else:
            measured = max(1, math.floor(per_pod))
            cap.method = (f"online: {per_pod:.1f} requests in flight per pod on average (Little's law) over the "
                          f"windows of maxBatchSize {batch}, which met the SLO; a lower bound when live traffic was "
                          "below what one instance holds")
    elif not host.problem.bounds():
        measured = max(1, batch - 1)
        cap.method = (f"benchmark: the best trial held {measured} users (maxBatchSize {batch} - 1, the guide's "
                      "client concurrency); no TTFT/TPOT bound to search further against")
    else:
        measured = _search(host, cap, batch)
        if measured is None:
            _write(host, cap)
            return True
    if measured is not None:
        cap.phase, cap.measuredConcurrencyPerReplica, cap.measuredAt = "Measured", measured, host.now
        cap.modelConcurrencyPerReplica, cap.modelSource = model_figure(host, batch)
        host.tuning.lastCheckAt = host.now  # the next SLO window must not cover a probe's load
        _scale(host, cap, spec.targetConcurrentUsers, spec.minReplicas, spec.maxReplicas, measured)
    _write(host, cap)
    return False


def model_figure(host: CapacityHost, batch: int) -> tuple[int | None, str]:
    """The simulator's per-instance concurrency for the tuned schedule (npuserve.sim.capacity), shown beside the
    measured one; a spec the simulator cannot run gets no figure and says why, and never stops the measurement."""
    from npuserve.sim.capacity import model_concurrency

    spec = host.isvc.spec
    # The verdict's own knobs: firstTokenAndDecode chooses supportSelectBatch too, which schedule_for cannot say.
    verdict = host.tuning.verdict
    chosen = next((t.schedule for t in host.tuning.history if verdict is not None and t.trial in verdict.trials
                   and t.schedule.maxBatchSize == batch), None)
    knobs = (TunedSchedule.from_knobs(chosen, "the verdict's trial") if chosen is not None
             else host.problem.schedule_for(batch))
    tuned = host.problem.full_schedule(knobs)
    try:
        return model_concurrency(spec, host.plan, spec.slo, tuned)
    except (ValueError, KeyError) as e:  # a card without figures (the host CPU), a model the cost model lacks
        return None, f"no model figure: {e}"


def _write(host: CapacityHost, cap: CapacityStatus) -> None:
    host.status["capacity"] = cap.model_dump(mode="json", exclude_none=True)


def _search(host: CapacityHost, cap: CapacityStatus, batch: int) -> int | None:
    """Benchmark probes from the best trial's load (a known pass) up to CAPACITY_LIMIT_FACTOR x its batch;
    the answer, or None while a probe runs (it opens the next one)."""
    low = max(1, batch - 1)
    ttft_bound = "ttft" in host.problem.bounds()
    # Users beyond maxBatchSize only wait: TPOT never sees them, TTFT does. Without a TTFT bound one instance
    # holds at most its batch; with one, the search goes past it until the queueing shows in TTFT.
    limit = max(low, CAPACITY_LIMIT_FACTOR * batch if ttft_bound else batch)
    if not cap.probes:
        cap.probes.append(CapacityProbe(concurrency=low, passed=True,
                                        verdict="the best trial's load (maxBatchSize - 1): met the SLO"))
    nxt = next_capacity_probe({p.concurrency: p.passed for p in cap.probes}, limit)
    if nxt is None:
        answer = max(p.concurrency for p in cap.probes if p.passed)
        top = ""
        if answer >= limit:
            top = (" (the search's limit, 2 x maxBatchSize: it may hold more)" if ttft_bound
                   else " (at most maxBatchSize: without a TTFT bound, users beyond it only wait in the queue)")
        cap.method = (f"benchmark: the largest client concurrency whose TTFT/TPOT met the SLO against one "
                      f"instance at maxBatchSize {batch}, by doubling and bisection over {len(cap.probes)} "
                      f"probes{top}")
        return answer
    if not host.pods_ready():
        cap.message = "waiting for every engine pod to be ready before the next capacity probe"
        return None
    cap.phase = "Measuring"
    cap.message = host.open_probe(len(cap.probes), nxt)
    return None


def close_probe(host: CapacityHost, current: TrialInProgress, metrics: TrialMetrics) -> None:
    """A probe's window, judged: recorded, and the search goes on."""
    cap = CapacityStatus.model_validate(host.status["capacity"])
    judgement = host.problem.judge(metrics)
    stat = host.problem.statistic
    verdict = (f"TTFT {stat} {metrics.ttftMs.of(stat):.1f} ms, TPOT {stat} {metrics.tpotMs.of(stat):.1f} ms, "
               f"{metrics.outputTokensPerSecond:.0f} tok/s: {'met' if judgement.meets else 'missed'} the SLO"
               + (f" ({judgement.why})" if judgement.why else ""))
    assert current.concurrency is not None
    cap.probes.append(CapacityProbe(concurrency=current.concurrency, passed=judgement.meets, verdict=verdict))
    _write(host, cap)
    host.event("Normal", "CapacityProbe", f"{current.concurrency} users: {verdict}")
    advance(host)


def _scale(host: CapacityHost, cap: CapacityStatus, target: int, low: int, high: int | None,
           per_replica: int) -> None:
    want = math.ceil(target / per_replica)
    replicas, bound = want, None
    if replicas < low:
        replicas, bound = low, f"spec.capacity.minReplicas ({low})"
    if high is not None and replicas > high:
        replicas, bound = high, f"spec.capacity.maxReplicas ({high})"
    limit = host.obs.replica_limit
    if limit is not None and replicas > limit:
        replicas, bound = limit, (f"the nodes' allocatable accelerators hold {limit} replicas" if host.plan.nodes <= 1
                                  else f"the nodes' allocatable accelerators hold {limit} replicas of "
                                  f"{host.plan.nodes} pods, one per node")
    cap.replicas, cap.bound = replicas, bound
    cap.message = (f"{target} users / {per_replica} per replica (measured) -> {want} replicas"
                   + (f", bounded by {bound}: {replicas}" if bound else "")
                   + f"; the plan's static estimate: {cap.staticConcurrencyPerReplica} per replica -> "
                   f"{cap.staticReplicas}")
    if host.isvc.spec.replicas != replicas:
        host.actions.scale = replicas
        host.event("Normal", "Scaled", cap.message)


def group_limit(pods_per_node: Sequence[int], nodes: int) -> int:
    """Replicas of `nodes` pods each, every pod of a replica on a different node (a LeaderWorkerSet group's required
    anti-affinity), that nodes holding `pods_per_node` pods each can take: the largest g with
    sum over nodes of min(pods there, g) >= g x nodes (a node gives each replica at most one pod). With nodes 1 it is
    the pods all nodes hold; with one pod per node it is the nodes that hold one, divided by `nodes`."""
    width = max(nodes, 1)
    held = [p for p in pods_per_node if p > 0]
    best, high = 0, sum(held) // width
    while best < high:  # the condition holds for g and fails above the largest: bisect
        g = (best + high + 1) // 2
        if sum(min(p, g) for p in held) >= g * width:
            best = g
        else:
            high = g - 1
    return best


def next_capacity_probe(passes: Mapping[int, bool], limit: int) -> int | None:
    """The next client concurrency to probe, or None when the search is done: doubling from the largest pass until a
    failure or `limit`, then bisection until the bracket is within CAPACITY_TOLERANCE."""
    ok = [c for c, p in passes.items() if p]
    if not ok:
        return None
    low = max(ok)
    fails = [c for c, p in passes.items() if not p and c > low]
    if not fails:
        return None if low >= limit else min(limit, low * 2)
    high = min(fails)
    if high - low <= max(1, math.ceil(CAPACITY_TOLERANCE * low)):
        return None
    return (low + high) // 2
