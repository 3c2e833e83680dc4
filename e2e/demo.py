#!/usr/bin/env python3
"""`make demo`: the mission on a local cluster, end to end: `kubectl apply` an InferenceService and watch the operator
tune its engine's batch parameters from live TTFT/TPOT in Prometheus, then size the replicas from what one instance
was measured to hold.

1. the local Kubernetes cluster (real API server, KWOK nodes, the process kubelet that runs each engine pod as a real
   `npuserve serve` on the pod's IP, Prometheus scraping the engines through the chart's PodMonitor), built on first
   use;
2. `helm install` of the chart (CRD, RBAC; the operator itself runs here, outside the cluster, with replicaCount 0);
3. the demo's model (random weights in the HF format, with its tokenizer) and `npuserve operator --prometheus-url`;
4. `kubectl apply -f examples/demo.yaml`: planned, deployed, then tuned in benchmark mode (a load-generator Job per
   trial): the `kubectl get nisvc -w` view and each trial as it lands;
5. the final status (best schedule, SLOMet, capacity and replicas), a PNG of the trials (maxBatchSize, TPOT,
   throughput), and a completion through the official `openai` client;
6. the operator stops; the cluster keeps running for you to look around (`make demo-down` removes it all).

Run by path (`.venv/bin/python e2e/demo.py`), never with `-m` from the repository root (its `operator/` folder).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "cluster"))

import localk8s
import yaml
from models import create_dummy_for

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "demo.yaml"
NAMESPACE = "default"
CHART = REPO / "deploy" / "helm" / "npuserve"
DEMO_DIR = REPO / ".demo"
TIMEOUT_S = 1800
TRIAL_COLUMNS = ("trial", "maxBatchSize", "TPOT ms", "TTFT ms", "tok/s", "requests", "SLO", "verdict")
WIDTHS = (6, 12, 8, 8, 7, 8, 13, 0)


def step(title: str) -> None:
    print(f"\n\033[1m== {title}\033[0m", flush=True)


def manifest(model: Path) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"]["namespace"] = NAMESPACE
    obj["spec"]["model"]["weights"] = {"hostPath": {"path": str(model)}}  # the folder this script wrote
    return obj


def slo_cell(entry: dict[str, Any]) -> str:
    """What the judge made of one window: met, missed (the figures over their bounds), failed or inconclusive."""
    if entry.get("outcome") == "inconclusive":
        return "inconclusive"
    if entry.get("outcome") == "failed":
        return "failed"
    return "met" if entry.get("sloMet") else "missed"


def trial_row(entry: dict[str, Any], mark: str = "") -> str:
    m = entry.get("metrics") or {}
    cells = [f"{entry['trial']}{mark}", str(entry["schedule"].get("maxBatchSize", "")),
             f"{m['tpotMs']['mean']:.1f}" if m else "-", f"{m['ttftMs']['mean']:.0f}" if m else "-",
             f"{m['outputTokensPerSecond']:.1f}" if m else "-", f"{m['samples']:.0f}" if m else "-",
             slo_cell(entry), entry.get("verdict", "")]
    return "  ".join(c.ljust(w) for c, w in zip(cells, WIDTHS, strict=True))


def table_header() -> str:
    return "  ".join(c.ljust(w) for c, w in zip(TRIAL_COLUMNS, WIDTHS, strict=True))


def evidence(tuning: dict[str, Any]) -> set[int]:
    """The trials the verdict rests on: the windows measured at the chosen schedule."""
    return set((tuning.get("verdict") or {}).get("trials") or [])


def pooled_by_requests(entries: list[dict[str, Any]], figure: str, statistic: str = "mean") -> float:
    """One latency figure (`tpotMs`, `ttftMs`) of measured status.tuning.history entries, pooled by their requests
    (computed here, not taken from the operator's pooled figures)."""
    weights = [max(e["metrics"]["samples"], 1) for e in entries]
    return sum(e["metrics"][figure][statistic] * w for e, w in zip(entries, weights, strict=True)) / sum(weights)


def verdict_contradiction(status: dict[str, Any], slo: dict[str, Any]) -> str | None:
    """Why the final status contradicts its own measurements, or None: SLOMet=True while the windows measured at the
    chosen schedule, pooled by requests (computed here from the history, not taken from the operator's figures),
    miss a bound at the SLO's statistic."""
    met = any(c.get("type") == "SLOMet" and c.get("status") == "True" for c in status.get("conditions") or [])
    if not met:
        return None
    tuning = status.get("tuning") or {}
    best = (tuning.get("best") or {}).get("schedule") or {}
    windows = [e for e in tuning.get("history") or []
               if e.get("outcome") == "measured" and e.get("metrics") and e["schedule"] == best]
    if not windows:
        return "SLOMet is True but no window was measured at the best schedule"
    statistic = slo.get("statistic", "mean")
    for figure, bound_key in (("tpotMs", "tpotMs"), ("ttftMs", "ttftMs")):
        bound = slo.get(bound_key)
        if bound is None:
            continue
        pooled = pooled_by_requests(windows, figure, statistic)
        if pooled > bound:
            return (f"SLOMet is True but the {len(windows)} window(s) measured at maxBatchSize "
                    f"{best.get('maxBatchSize')} give {figure} {statistic} {pooled:.1f} ms, over the bound {bound:g}")
    return None


def watch(cluster: localk8s.Cluster, name: str) -> dict[str, Any]:
    """The `kubectl get nisvc -w` view and each trial and capacity probe as it lands, until tuning and the capacity
    measurement are done."""
    deadline = time.monotonic() + TIMEOUT_S
    last_row, trials_seen, probes_seen, message = "", 0, 0, ""
    header_done = False
    while time.monotonic() < deadline:
        table = cluster.kubectl("get", "nisvc", name, "-n", NAMESPACE, check=False).rstrip().splitlines()
        row = table[1].rsplit(None, 1)[0] if len(table) == 2 else ""  # AGE changes all the time: not a change
        if row and row != last_row:
            if not header_done:
                print(table[0])
                header_done = True
            print(table[1], flush=True)
            last_row = row
        obj = cluster.kubectl_json("get", "nisvc", name, "-n", NAMESPACE)
        status: dict[str, Any] = obj.get("status") or {}  # type: ignore[assignment]
        if status.get("phase") == "Failed":
            raise SystemExit(f"the InferenceService failed: {json.dumps(status.get('conditions'), indent=2)}")
        tuning = status.get("tuning") or {}
        history = tuning.get("history") or []
        for entry in history[trials_seen:]:
            if trials_seen == 0:
                print(f"   {table_header()}")
            print(f"   {trial_row(entry)}", flush=True)
        trials_seen = len(history)
        probes = (status.get("capacity") or {}).get("probes") or []
        for probe in probes[probes_seen:]:
            print(f"   capacity: {probe['concurrency']} users: {probe['verdict']}", flush=True)
        probes_seen = len(probes)
        if tuning.get("message") and tuning["message"] != message:
            message = tuning["message"]
            print(f"   \033[2m{message}\033[0m", flush=True)
        capacity = status.get("capacity") or {}
        finished = tuning.get("phase") in ("Converged", "Stopped", "Failed") and not tuning.get("current")
        wants_capacity = bool((obj.get("spec") or {}).get("capacity"))  # type: ignore[union-attr]
        if finished and (not wants_capacity or capacity.get("phase") in ("Measured", "Failed")):
            replicas = capacity.get("replicas")
            if replicas is None or status.get("replicas") == replicas:
                return status
        time.sleep(2)
    raise SystemExit(f"tuning did not finish in {TIMEOUT_S}s; see `kubectl describe nisvc {name}` and "
                     ".cluster/ logs")


def plot(tuning: dict[str, Any], slo_tpot: float | None, path: Path) -> Path:
    """TPOT and throughput per measured trial: green met the SLO, red missed it, black crosses failed; the chosen
    schedule's windows ringed in gold; numbers: trial order."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    history = tuning.get("history") or []
    chosen = evidence(tuning)
    measured = [e for e in history if e.get("metrics")]
    fig = Figure(figsize=(10, 4.8), layout="constrained")
    tpot_ax, tput_ax = fig.subplots(1, 2)
    style = {"met": ("o", "tab:green"), "missed": ("o", "tab:red"), "failed": ("x", "black")}
    for ax, figure in ((tpot_ax, lambda m: m["tpotMs"]["mean"]), (tput_ax, lambda m: m["outputTokensPerSecond"])):
        for kind, (marker, color) in style.items():
            points = [e for e in measured if slo_cell(e) == kind]
            if points:  # points, not a line: a batch measured again is several points at one x
                ax.plot([e["schedule"]["maxBatchSize"] for e in points], [figure(e["metrics"]) for e in points],
                        marker, color=color, linestyle="none", label=kind)
        best = [e for e in measured if e["trial"] in chosen]
        if best:
            ax.plot([e["schedule"]["maxBatchSize"] for e in best], [figure(e["metrics"]) for e in best], "o",
                    markersize=14, markerfacecolor="none", markeredgecolor="goldenrod", markeredgewidth=2,
                    linestyle="none", label="chosen")
        for e in measured:
            ax.annotate(str(e["trial"]), (e["schedule"]["maxBatchSize"], figure(e["metrics"])),
                        textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.grid(alpha=0.3)
    if slo_tpot is not None:
        tpot_ax.axhline(slo_tpot, color="tab:red", linestyle="--", label=f"SLO TPOT {slo_tpot:g} ms")
    tpot_ax.set(xlabel="maxBatchSize", ylabel="mean TPOT (ms)", title="TPOT per trial")
    tput_ax.set(xlabel="maxBatchSize", ylabel="output tokens/s", title="throughput per trial")
    tpot_ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def talk_to_engine(pod_ip: str, model: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"http://{pod_ip}:8000/v1", api_key="unused")
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16,
                                           temperature=0)
    print(f"completion: {completion.choices[0].text!r}")
    print(f"usage: {completion.usage}")


def main() -> int:
    started = time.monotonic()
    step("local cluster with Prometheus (the first run builds Kubernetes, KWOK, Helm and Prometheus from the Go "
         "module proxy: 15-25 minutes)")
    localk8s.ensure_binaries(with_helm=True)
    cluster = localk8s.up()
    env = {**os.environ, **cluster.env()}
    print(cluster.kubectl("get", "nodes", "-o", "custom-columns=NODE:.metadata.name,"
                          "ASCEND910:.status.allocatable.huawei\\.com/Ascend910").rstrip())
    print(f"Prometheus: {cluster.prometheus_url}")

    step("helm install npuserve (CRD, RBAC; the operator runs outside the cluster)")
    helm = str(localk8s.ensure_binaries(with_helm=True).helm)
    subprocess.run([helm, "upgrade", "--install", "npuserve", str(CHART), "--namespace", "npuserve-system",
                    "--create-namespace", "--set", "replicaCount=0", "--set",
                    f"prometheus.url={cluster.prometheus_url}", "--wait"], env=env, check=True)

    obj = manifest(DEMO_DIR / "models" / "demo")
    name = obj["metadata"]["name"]
    step("the model: random weights in the HF format, with its tokenizer (npuserve model create-dummy)")
    model = create_dummy_for(obj["spec"], DEMO_DIR / "models" / "demo")
    print(f"{model}: {json.loads((model / 'config.json').read_text())['num_hidden_layers']} layers")

    step("npuserve operator --prometheus-url " + cluster.prometheus_url)
    log_path = cluster.kubeconfig.parent / "demo-operator.log"
    npuserve = str(Path(sys.executable).parent / "npuserve")
    with log_path.open("w") as log:
        operator = subprocess.Popen([npuserve, "operator", "--all-namespaces", "--prometheus-url",
                                     cluster.prometheus_url], env=env, stdout=log, stderr=subprocess.STDOUT)
    print(f"operator pid {operator.pid}, log {log_path}")
    contradiction: str | None = None
    try:
        step(f"kubectl apply -f examples/{EXAMPLE.name}: plan, deploy, tune (a load-generator Job per trial)")
        cluster.kubectl("delete", "nisvc", name, "-n", NAMESPACE, "--ignore-not-found", "--wait=true", timeout=120)
        print(cluster.kubectl("apply", "-f", "-", input=json.dumps(obj)).rstrip())
        status = watch(cluster, name)

        step("the result")
        tuning, capacity = status.get("tuning") or {}, status.get("capacity") or {}
        best = tuning.get("best") or {}
        slo = next((c for c in status.get("conditions") or [] if c["type"] == "SLOMet"), {})
        print(f"tuning: {tuning.get('phase')} after {tuning.get('trial')} trials: {tuning.get('message')}")
        print(f"best: {json.dumps(best.get('schedule'))}; what bounds it: "
              f"{(tuning.get('verdict') or {}).get('limit', '-')}")
        print(f"SLOMet: {slo.get('status')} ({slo.get('message')})")
        print(f"observed: {json.dumps(status.get('observed'))}")
        if capacity:
            print(f"capacity: {capacity.get('measuredConcurrencyPerReplica')} users per replica, measured "
                  f"({capacity.get('method')}); the plan's static estimate: "
                  f"{capacity.get('staticConcurrencyPerReplica')} per replica, {capacity.get('staticReplicas')} "
                  f"replicas")
            print(f"replicas: {capacity.get('replicas')} ({capacity.get('message')})")
        chosen = evidence(tuning)
        print(f"the trials (* the chosen schedule's windows, on which the verdict rests):\n   {table_header()}")
        for entry in tuning.get("history") or []:
            print(f"   {trial_row(entry, '*' if entry['trial'] in chosen else '')}")
        DEMO_DIR.mkdir(exist_ok=True)
        png = plot(tuning, obj["spec"]["slo"].get("tpotMs"), DEMO_DIR / "trials.png")
        print(f"trials plotted: {png}")
        contradiction = verdict_contradiction(status, obj["spec"]["slo"])
        print(cluster.kubectl("get", "deployment,pods", "-n", NAMESPACE, "-o", "wide", "-l",
                              f"npuserve.io/inferenceservice={name},app.kubernetes.io/component=engine").rstrip())
        pods = cluster.kubectl_json("get", "pods", "-n", NAMESPACE, "-l",
                                    f"npuserve.io/inferenceservice={name},app.kubernetes.io/component=engine")
        items = pods["items"]
        assert isinstance(items, list) and items
        step(f"the engine at http://{items[0]['status']['podIP']}:8000 through the official openai client")
        talk_to_engine(items[0]["status"]["podIP"], obj["spec"]["model"]["name"])
    finally:
        operator.terminate()
        operator.wait(30)
    if contradiction is not None:
        print(f"\033[1;31mthe verdict contradicts its own measurements: {contradiction}\033[0m", file=sys.stderr)
        return 1
    step(f"done in {time.monotonic() - started:.0f}s")
    print(f"The cluster keeps running: export KUBECONFIG={cluster.kubeconfig}; kubectl describe nisvc {name}")
    print("Remove it all with: make demo-down")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
