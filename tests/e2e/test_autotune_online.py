"""Closed-loop tuning in online mode on the local cluster: no benchmark Job, live traffic that the test drives itself
(`npuserve bench` processes against the two engine pods), the operator tuning from what Prometheus scraped of it.

The bound is calibrated on this machine first (with autotune off): the mean TPOT at 2 and at 24 users per pod, both
pods loaded at once as they are later; the SLO is their geometric mean. Then, in order:
1. 2 users per pod: every maxBatchSize meets the bound, so tuning converges at the plan's memory bound (64), with
   SLOMet=True from the windows measured there; `status.observed` keeps being refreshed window by window;
2. 24 users per pod: the tuned batch now runs 24 requests per engine and misses the bound; after consecutive missed
   windows the operator starts a new round and converges again, at a batch whose own windows meet the bound.

Also here: benchmark mode with a CPU hog started beside the engine mid-tuning (one busy core for a bounded time):
the verdict may be conservative, never false.
"""

from __future__ import annotations

import base64
import json
import math
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import demo
import httpx
import localk8s
import pytest
import yaml
from operator_harness import REPO, Operator, say, scratch_namespace, wait_for

from npuserve.engine_contract import ADMIN_SCHEDULE_PATH, INFO_PATH, SCHEDULE_GENERATION_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

# 10 s windows (the operator's default is 2m; the engines are scraped every second here, e2e/cluster/lifecycle.py)
# with live requests of 32 output tokens: half the window and half the request of a 20 s window with 64 tokens, so a
# window holds as many finished requests, and the settling time (at most a window) still outlasts the requests in
# flight at a change under the heavy traffic. With 10 s windows and 64 tokens, round 2 measured batch 1 over the
# bound: its windows held requests begun at the batch before.
WINDOW = "10s"
OUTPUT_TOKENS = 32
LIGHT, HEAVY = 2, 24  # users per pod
SMALL_BATCH = 4
NPUSERVE = str(Path(sys.executable).parent / "npuserve")


def manifest(namespace: str, name: str, model: Path, **autotune: Any) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    obj["metadata"] = {"name": name, "namespace": namespace}
    spec = obj["spec"]
    spec["model"]["weights"] = {"hostPath": {"path": str(model)}}
    spec.pop("capacity")
    spec["autotune"] = {"window": WINDOW, "maxTrials": 8, "minSamples": 10, **autotune}
    return obj


def status(cluster: localk8s.Cluster, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = cluster.kubectl_json("get", "nisvc", name, "-n", namespace).get("status") or {}
    return found


def ready_pod_ips(cluster: localk8s.Cluster, namespace: str, name: str) -> list[str]:
    pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l",
                                f"npuserve.io/inferenceservice={name},app.kubernetes.io/component=engine")["items"]
    assert isinstance(pods, list)
    return sorted(p["status"]["podIP"] for p in pods if not p["metadata"].get("deletionTimestamp")
                  and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or []))


class Traffic:
    """Live traffic: one closed-loop `npuserve bench` per engine pod, `users` each, bounded by `duration_s`."""

    def __init__(self, ips: list[str], users: int, duration_s: float, model: Path) -> None:
        self.procs = [subprocess.Popen(
            [NPUSERVE, "bench", "--base-url", f"http://{ip}:8000", "--model", "demo", "--tokenizer", str(model),
             "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", str(OUTPUT_TOKENS),
             "--ignore-eos",
             "--max-concurrency", str(users), "--duration", f"{duration_s:g}", "--num-prompts", "100000",
             "--format", "json", "--request-timeout", "120"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for ip in ips]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    def reports(self) -> list[dict[str, Any]]:
        out = []
        for p in self.procs:
            stdout, _ = p.communicate(timeout=120)
            out.append(json.loads(stdout))
        return out


def set_batch(cluster: localk8s.Cluster, namespace: str, name: str, ips: list[str], batch: int) -> None:
    """maxBatchSize on every engine, as the operator sets it (PUT /admin/schedule with the admin Secret's token), at
    the schedule generation after the one the engine runs: an older or equal one is refused (409). The operator's
    own generations (autotune.next_generation) go past it once the spec changes to turn tuning on."""
    secret = cluster.kubectl_json("get", "secret", f"{name}-admin", "-n", namespace)
    token = base64.b64decode(secret["data"]["token"]).decode()  # type: ignore[index]
    for ip in ips:
        running = httpx.get(f"http://{ip}:8000{INFO_PATH}", timeout=10).json().get(SCHEDULE_GENERATION_KEY) or 0
        answer = httpx.put(f"http://{ip}:8000{ADMIN_SCHEDULE_PATH}", headers={"Authorization": f"Bearer {token}"},
                           json={"maxBatchSize": batch, "maxPrefillBatchSize": max(1, batch // 2),
                                 SCHEDULE_GENERATION_KEY: running + 1}, timeout=10)
        assert answer.status_code == 200, answer.text


def calibrate(ips: list[str], model: Path, users: int) -> float:
    """Mean TPOT (ms) with `users` per pod on every pod at once, for 15 s."""
    traffic = Traffic(ips, users, 15, model)
    reports = traffic.reports()
    tpots = [r["metrics"]["tpot_ms"]["mean"] for r in reports]
    return sum(tpots) / len(tpots)


def converged(cluster: localk8s.Cluster, namespace: str, name: str, round_: int) -> dict[str, Any] | None:
    st = status(cluster, namespace, name)
    tuning = st.get("tuning") or {}
    if tuning.get("round") == round_ and tuning.get("phase") in ("Converged", "Stopped", "Failed") \
            and not tuning.get("current"):
        return st
    return None


def trials(st: dict[str, Any]) -> str:
    """The round's history, one line a trial (printed: where a run's time and trials went)."""
    rows = []
    for e in (st.get("tuning") or {}).get("history") or []:
        m = e.get("metrics") or {}
        tpot = (m.get("tpotMs") or {}).get("mean")
        batch = (e.get("schedule") or {}).get("maxBatchSize")
        rows.append(f"  {e.get('trial')} maxBatchSize {batch} {e.get('outcome')}: "
                    f"TPOT {tpot if tpot is None else round(tpot, 1)} ms, {m.get('samples')} requests, "
                    f"{m.get('inFlightPerPod')} in flight per pod")
    return "\n".join(rows)


def slo_met(st: dict[str, Any]) -> bool:
    return any(c["type"] == "SLOMet" and c["status"] == "True" for c in st.get("conditions") or [])


def test_online_tuning_follows_live_traffic_and_tunes_again_when_it_changes(
        k8s_cluster: localk8s.Cluster, tuning_operator: Operator, demo_model_dir: Path) -> None:
    """What it proves (whatever the window's length): in online mode, with no Job, round 1 under light traffic
    converges at the plan's memory bound with SLOMet=True and a verdict its own windows back; status.observed is
    refreshed after the verdict; heavy traffic then misses the SLO, a TuningRestarted event starts round 2, and
    round 2 ends (converged, SLOMet=True; or out of trials) at a smaller maxBatchSize whose own windows meet the
    bound."""
    name = "online"
    with scratch_namespace(k8s_cluster, "e2e-online-") as ns:
        # 12 trials a round: on two shared cores, two engines and their clients measure with +-10-15% noise per
        # window, and the tuner spends repeats on it rather than claim what it cannot show.
        obj = manifest(ns, name, demo_model_dir, enabled=False, mode="online", maxTrials=12)
        obj["spec"]["replicas"] = 2
        k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
        ips = wait_for("two engine pods Ready", lambda: (lambda i: i if len(i) == 2 else None)(
            ready_pod_ips(k8s_cluster, ns, name)), timeout=300)
        light, heavy = calibrate(ips, demo_model_dir, LIGHT), calibrate(ips, demo_model_dir, HEAVY)
        # What a small batch gives under the heavy traffic (the queue's own cost included): round 2's answer lies
        # between it and `heavy`.
        set_batch(k8s_cluster, ns, name, ips, SMALL_BATCH)
        small = calibrate(ips, demo_model_dir, HEAVY)
        bound = math.sqrt(max(light, small) * heavy)
        say(f"\ncalibrated: TPOT {light:.1f} ms at {LIGHT} users per pod, {heavy:.1f} ms at {HEAVY}, {small:.1f} ms "
            f"at {HEAVY} with maxBatchSize {SMALL_BATCH}; the SLO: {bound:.1f} ms")
        assert heavy > 1.3 * max(light, small), "the load must raise TPOT for the test to mean anything"

        traffic = Traffic(ips, LIGHT, 1500, demo_model_dir)
        try:
            k8s_cluster.kubectl("patch", "nisvc", name, "-n", ns, "--type=merge", "-p", json.dumps(
                {"spec": {"slo": {"objective": "decodeLatency", "tpotMs": round(bound, 1)},
                          "autotune": {"enabled": True}}}))
            st = wait_for("round 1 to converge", lambda: converged(k8s_cluster, ns, name, 1), timeout=900,
                          interval=2)
            tuning = st["tuning"]
            say("round 1: " + tuning["message"], trials(st))
            # The online model of the CPU engine, as the status records it (issue 33 asks its next-window TPOT
            # within 15% after three windows on this engine: printed for the record, here and in round 2, not
            # asserted).
            say("round 1 model: " + json.dumps(tuning.get("model")))
            assert tuning["phase"] == "Converged" and slo_met(st), tuning["message"]
            assert tuning["verdict"]["sloMet"] and tuning["verdict"]["limit"] == "memory"
            assert tuning["verdict"]["maxBatchSize"] == st["plan"]["maxBatchSize"]["max"]
            assert demo.verdict_contradiction(st, {"tpotMs": round(bound, 1)}) is None
            assert not k8s_cluster.kubectl_json("get", "jobs", "-n", ns)["items"], "online mode: no Job"
            first_batch = tuning["verdict"]["maxBatchSize"]
            # status.observed stays current: a later window replaces it.
            seen = st["observed"]["measuredAt"]
            st = wait_for("status.observed refreshed", lambda: (lambda s: s if s["observed"]["measuredAt"] != seen
                                                                else None)(status(k8s_cluster, ns, name)),
                          timeout=120, interval=2)
            assert st["observed"]["sloMet"] is True and st["observed"]["samples"] >= 1
        finally:
            traffic.stop()

        traffic = Traffic(ips, HEAVY, 1500, demo_model_dir)
        try:
            st = wait_for("round 2 to start", lambda: (lambda s: s if (s.get("tuning") or {}).get("round") == 2
                                                       else None)(status(k8s_cluster, ns, name)),
                          timeout=600, interval=2)
            # The operator writes the status first, then applies the schedule to every engine, then posts the
            # events (record, then act): under the heavy traffic the event comes a little after round 2 shows.
            wait_for("the TuningRestarted event", lambda: "TuningRestarted" in k8s_cluster.kubectl(
                "get", "events", "-n", ns, "--field-selector", "reason=TuningRestarted"), timeout=60, interval=2)
            st = wait_for("round 2 to converge", lambda: converged(k8s_cluster, ns, name, 2), timeout=1200,
                          interval=2)
            tuning = st["tuning"]
            say("round 2: " + tuning["message"], trials(st))
            say("round 2 model: " + json.dumps(tuning.get("model")))
            # Converged with SLOMet=True; or out of trials at a smaller batch whose own windows meet the bound as
            # measured, the verdict's sloMet True only where the noise lets it be shown. One CI run measured +-18.5%
            # per window here (this machine: +-3-8%) and after 12 trials held maxBatchSize 7 at 0.80x the bound in 1
            # window, and said it was not certain. How many windows certainty takes is the noise's, not the tuner's.
            verdict = tuning["verdict"]
            assert tuning["phase"] in ("Converged", "Stopped"), tuning["message"]
            assert verdict["reason"] in ("converged", "maxTrials") and verdict["maxBatchSize"] < first_batch, verdict
            if verdict["reason"] == "converged" or verdict["sloMet"]:
                assert verdict["sloMet"] and slo_met(st), tuning["message"]
            chosen = [e for e in tuning["history"] if e["trial"] in verdict["trials"] and e.get("metrics")]
            assert chosen and demo.pooled_by_requests(chosen, "tpotMs") <= round(bound, 1), trials(st)
            # The window that started round 2 is its trial 0 (online mode): round 1's batch, missing the bound.
            seed = tuning["history"][0]
            assert seed["schedule"]["maxBatchSize"] == first_batch and seed["sloMet"] is False, seed
            # ...and it is the window that started the round, measured before it (a window the round opened would
            # end after roundStartedAt).
            seed_end = datetime.fromisoformat(seed["window"].split("/")[1])
            assert seed_end <= datetime.fromisoformat(tuning["roundStartedAt"]), (seed, tuning["roundStartedAt"])
            # Round 1's windows went with round 2 for its engine model (read while its adequacy test passes).
            assert tuning["earlier"] and all(e["outcome"] == "measured" for e in tuning["earlier"]), tuning["earlier"]
            started = k8s_cluster.kubectl("get", "events", "-n", ns, "--field-selector", "reason=TrialStarted",
                                          "--sort-by=.lastTimestamp", "-o", "jsonpath={.items[*].message}")
            say("trials started (both rounds): " + started)
            met = [e["trial"] for e in tuning["history"] if e.get("sloMet")]
            say(f"round 2: the first window to meet the SLO is trial {met[0] if met else None} (the seed is 0)")
            # Issue 33: the SLO met again within 2 trials of the round (1 in the runs so far: half the batch the
            # seed ran at).
            assert met and met[0] <= 2, trials(st)
            assert demo.verdict_contradiction(st, {"tpotMs": round(bound, 1)}) is None
        finally:
            traffic.stop()


def test_a_cpu_hog_mid_tuning_makes_the_verdict_conservative_never_false(
        k8s_cluster: localk8s.Cluster, tuning_operator: Operator, demo_model_dir: Path) -> None:
    """What it proves: a busy core beside the engine from the second trial on, benchmark mode, and the final status
    never claims SLOMet for a schedule whose own windows (pooled) miss the bound; if SLOMet, the verdict says so
    with the pooled TPOT under the bound."""
    name = "hog"
    with scratch_namespace(k8s_cluster, "e2e-hog-") as ns:
        obj = manifest(ns, name, demo_model_dir, enabled=True, mode="benchmark", maxTrials=6)
        k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
        wait_for("the first measured trial", lambda: [e for e in (status(k8s_cluster, ns, name).get("tuning") or {})
                                                      .get("history") or [] if e["outcome"] == "measured"],
                 timeout=600, interval=2)
        # One core kept busy for at most 150 s, beside the engine (2 cores in all), from the second trial on.
        hog = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + 150\n"
                                "while time.monotonic() < end:\n    pass\n"])
        try:
            st = wait_for("tuning to finish", lambda: converged(k8s_cluster, ns, name, 1), timeout=1200, interval=2)
        finally:
            hog.kill()
            hog.wait()
        tuning = st["tuning"]
        say("\nwith a CPU hog: " + tuning["message"], trials(st))
        slo = obj["spec"]["slo"]
        assert demo.verdict_contradiction(st, slo) is None, tuning["message"]
        if slo_met(st):
            assert tuning["verdict"]["sloMet"] and tuning["verdict"]["pooled"]["tpotMs"]["mean"] <= slo["tpotMs"]
