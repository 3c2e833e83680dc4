#!/usr/bin/env python3
"""`make demo`: the main job on a local cluster, end to end.

1. the local Kubernetes cluster (real API server, KWOK nodes with 8 huawei.com/Ascend910 each, the process kubelet
   that runs each engine pod as a real `npuserve serve` on the pod's IP), built on first use;
2. `helm install` of the chart (CRD, RBAC; the operator itself runs here, outside the cluster, with replicaCount 0);
3. `npuserve operator`;
4. `kubectl apply -f examples/tiny-cpu.yaml`: the operator plans, renders and applies; the pod comes up Ready;
5. a completion and a streamed chat through the official `openai` client to the engine's pod IP, its metrics;
6. the operator stops; the cluster keeps running for you to look around (`make cluster-down` stops it).

Run by path (`.venv/bin/python e2e/demo.py`), never with `-m` from the repository root (its `operator/` folder).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "cluster"))

import localk8s

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-cpu.yaml"
NAME = "tiny"
NAMESPACE = "default"
CHART = REPO / "deploy" / "helm" / "npuserve"


def step(title: str) -> None:
    print(f"\n\033[1m== {title}\033[0m", flush=True)


def wait_ready(cluster: localk8s.Cluster, timeout: float = 600) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        table = cluster.kubectl("get", "nisvc", NAME, "-n", NAMESPACE, check=False)
        if table != last:
            print(table.rstrip(), flush=True)
            last = table
        obj = cluster.kubectl_json("get", "nisvc", NAME, "-n", NAMESPACE)
        status = obj.get("status") or {}
        assert isinstance(status, dict)
        if status.get("phase") == "Ready":
            return status
        if status.get("phase") == "Failed":
            raise SystemExit(f"the InferenceService failed: {json.dumps(status.get('conditions'), indent=2)}")
        time.sleep(2)
    raise SystemExit(f"not Ready after {timeout:.0f}s; see `kubectl describe nisvc {NAME}` and .cluster/ logs")


def talk_to_engine(pod_ip: str, model: str) -> None:
    import httpx
    import openai

    client = openai.OpenAI(base_url=f"http://{pod_ip}:8000/v1", api_key="unused")
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16,
                                           temperature=0)
    print(f"completion: {completion.choices[0].text!r}")
    print(f"usage: {completion.usage}")
    print(f"timings: {(completion.model_extra or {}).get('npuserve')}")
    print("chat (streamed): ", end="", flush=True)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=24, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    metrics = httpx.get(f"http://{pod_ip}:8000/metrics", timeout=10).text
    wanted = ("npuserve:generation_tokens_total", "npuserve:time_to_first_token_seconds_count",
              "npuserve:kv_cache_blocks_total", "npuserve:num_requests_running")
    for line in metrics.splitlines():
        if line.startswith(wanted):
            print(f"  {line}")


def main() -> int:
    step("local cluster (the first run builds Kubernetes from the Go module proxy: 15-25 minutes)")
    localk8s.ensure_binaries(with_helm=True)
    cluster = localk8s.up()
    env = {**os.environ, **cluster.env()}
    print(cluster.kubectl("get", "nodes", "-o", "custom-columns=NODE:.metadata.name,"
                          "ASCEND910:.status.allocatable.huawei\\.com/Ascend910").rstrip())

    step("helm install npuserve (CRD, RBAC; the operator runs outside the cluster)")
    helm = str(localk8s.ensure_binaries(with_helm=True).helm)
    subprocess.run([helm, "upgrade", "--install", "npuserve", str(CHART), "--namespace", "npuserve-system",
                    "--create-namespace", "--set", "replicaCount=0", "--wait"], env=env, check=True)

    step("npuserve operator")
    log_path = cluster.kubeconfig.parent / "demo-operator.log"
    npuserve = str(Path(sys.executable).parent / "npuserve")
    with log_path.open("w") as log:
        operator = subprocess.Popen([npuserve, "operator", "--all-namespaces"], env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
    print(f"operator pid {operator.pid}, log {log_path}")
    try:
        step(f"kubectl apply -f examples/{EXAMPLE.name}")
        print(cluster.kubectl("apply", "-f", str(EXAMPLE)).rstrip())
        status = wait_ready(cluster)
        plan = status["plan"]
        assert isinstance(plan, dict)
        step("the plan (status.plan, = npuserve plan --from-file examples/tiny-cpu.yaml --format json)")
        for key in ("worldSize", "npuMemSizeGiB", "blockBytesPerCard", "totalBlocks", "blocksPerRequest",
                    "maxBatchSize", "replicas"):
            print(f"  {key:18} {json.dumps(plan[key])}")
        print(f"  {'schedule':18} {json.dumps(plan['schedule'])}")
        print(f"  observed: {json.dumps(status.get('observed'))}")
        step("what the operator made")
        print(cluster.kubectl("get", "configmap,deployment,service,pods", "-n", NAMESPACE, "-o", "wide",
                              "-l", f"npuserve.io/inferenceservice={NAME}").rstrip())
        pods = cluster.kubectl_json("get", "pods", "-n", NAMESPACE, "-l", f"npuserve.io/inferenceservice={NAME}")
        items = pods["items"]
        assert isinstance(items, list) and items
        pod_ip = items[0]["status"]["podIP"]
        step(f"the engine at http://{pod_ip}:8000 through the official openai client")
        talk_to_engine(pod_ip, str(plan["model"]))
    finally:
        operator.terminate()
        operator.wait(30)
    step("done")
    print(f"The cluster keeps running: export KUBECONFIG={cluster.kubeconfig}; kubectl describe nisvc {NAME}")
    print("Stop it with: make cluster-down")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
