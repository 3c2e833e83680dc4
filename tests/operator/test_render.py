"""Rendered objects: valid against the Kubernetes API schemas, carrying the plan, the guide's host tuning and what each
tensor-parallel rank needs (cards, cores, memory, /dev/shm, HCCL settings)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from isvc_helpers import EXAMPLES, REPO, load_yaml

from npuserve.mindie_config import MindIEConfig, MindIEConfigError
from npuserve.operator import render as r
from npuserve.planning.api import InferenceService, Plan
from npuserve.planning.planner import plan
from npuserve.planning.problem import TuningProblem

K8S_VERSION = "1.30.0"


def load(name: str, **spec_changes: Any) -> tuple[InferenceService, Plan]:
    data = load_yaml(REPO / "examples" / name)
    data["spec"].update(spec_changes)
    isvc = InferenceService.model_validate(data)
    return isvc, plan(isvc.spec)


def by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objects}


def pod_spec(workload: dict[str, Any], template: str = "template") -> dict[str, Any]:
    spec = workload["spec"]
    tpl = spec[template] if template == "template" else spec["leaderWorkerTemplate"][template]
    return dict(tpl["spec"])


def validate(obj: dict[str, Any]) -> None:
    if obj["kind"] == "LeaderWorkerSet":
        # Not a built-in kind: check each pod template against the PodTemplate schema.
        lwt = obj["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            kubernetes_validate.validate(
                {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": lwt[key]},
                K8S_VERSION, strict=True,
            )
        assert isinstance(lwt["size"], int) and lwt["size"] >= 2
        assert set(obj["spec"]) <= {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy",
                                    "networkConfig"}
    elif obj["kind"] == "PodMonitor":
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(obj["spec"]) == {"selector", "podMetricsEndpoints", "podTargetLabels"}
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}, K8S_VERSION, strict=True
        )
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_rendered_object_is_valid(path: Path) -> None:
    isvc = InferenceService.model_validate(load_yaml(path))
    objects = r.render(isvc, plan(isvc.spec))
    for obj in objects:
        validate(obj)
    kinds = [o["kind"] for o in objects]
    assert kinds[0] == "ConfigMap" and "Service" in kinds
    assert ("LeaderWorkerSet" in kinds) != ("Deployment" in kinds)


def test_configmap_holds_the_plans_mindie_config() -> None:
    isvc, p = load("llama3-8b-throughput.yaml")
    cm = by_kind(r.render(isvc, p))["ConfigMap"]
    config = MindIEConfig.from_dict(json.loads(cm["data"]["config.json"]))
    assert config.model.npuMemSize == 17 and config.model.worldSize == 2 and config.model.cpuMemSize == 5
    assert config.model.modelWeightPath == "/models"
    assert config.BackendConfig.npuDeviceIds == [[0, 1]]
    assert config.schedule.maxBatchSize == 435 and config.schedule.maxPrefillBatchSize == 217
    assert config.schedule.supportSelectBatch is True
    assert config.deploy.maxSeqLen == 2560 and config.deploy.maxInputTokenLen == 2048
    assert config.extensions.device == "npu" and config.extensions.servedModelName == "Meta-Llama-3-8B-Instruct"


def test_the_config_carries_the_quantization_the_spec_names() -> None:
    isvc, p = load("deepseek-r1-w8a8-multinode.yaml")
    config = json.loads(by_kind(r.render(isvc, p))["ConfigMap"]["data"]["config.json"])
    assert config["npuserve"]["quantization"] == {"format": "msmodelslim", "method": "w8a8"}
    assert MindIEConfig.from_dict(config).extensions.quantization == isvc.spec.model.quantization
    # a 16-bit model's config says so: no scheme, the engine serves what its checkpoint declares
    plain_isvc, plain = load("llama3-8b-throughput.yaml")
    assert r.mindie_config(plain_isvc, plain).extensions.quantization is None


def test_the_config_carries_the_plans_memory_maximum_as_the_batch_size_limit() -> None:
    isvc, p = load("llama3-8b-throughput.yaml")
    config = r.mindie_config(isvc, p)
    # maxBatchSize.max: floor(2176 blocks / 2 blocks of the 186-token average prompt), the tuner's largest proposal
    assert config.extensions.maxBatchSizeLimit == 1088 and config.schedule.maxBatchSize == 435
    assert TuningProblem.from_plan(p, isvc.spec.slo).batch_max == 1088
    tuned = r.mindie_config(isvc, p, p.schedule.model_copy(update={"maxBatchSize": 1088}))
    assert tuned.extensions.maxBatchSizeLimit == 1088  # the plan's, whatever the schedule
    with pytest.raises(MindIEConfigError, match=r"maxBatchSize \(1089\) exceeds npuserve\.maxBatchSizeLimit"):
        r.mindie_config(isvc, p, p.schedule.model_copy(update={"maxBatchSize": 1089}))
    # a pinned maxBatchSize past the memory maximum (the plan warns) is still one the engine must run
    pinned_isvc, pinned = load("llama3-8b-throughput.yaml", engine={"schedule": {"maxBatchSize": 2000}})
    assert r.mindie_config(pinned_isvc, pinned).extensions.maxBatchSizeLimit == 2000


def test_engine_container_command_resources_and_probes() -> None:
    isvc, p = load("llama3-8b-throughput.yaml")
    deployment = by_kind(r.render(isvc, p))["Deployment"]
    assert deployment["spec"]["replicas"] == p.replicas == 28
    (engine,) = pod_spec(deployment)["containers"]
    assert engine["command"] == ["npuserve", "serve", "--model", "/models", "--config", "/etc/npuserve/config.json",
                                 "--host", "0.0.0.0", "--port", "8000"]
    res = engine["resources"]
    assert res["requests"]["huawei.com/Ascend910"] == res["limits"]["huawei.com/Ascend910"] == "2"
    assert res["requests"]["cpu"] == res["limits"]["cpu"] == "16"  # integer, equal: exclusive cores
    assert res["requests"]["memory"] == res["limits"]["memory"]
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert engine["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    # a refusal at start-up (npuserve doctor's failed checks on npu) is the container's termination message
    assert engine["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # the engine's fatal message, written where the kubelet reads it
    assert engine["terminationMessagePath"] == "/dev/termination-log"
    # the liveness budget fits the step watchdog: the engine exits by itself (after its grace) before the kubelet
    # would kill it, so the pod's termination message is the engine's
    liveness = engine["livenessProbe"]
    budget = liveness["periodSeconds"] * liveness["failureThreshold"]
    grace = r.mindie_config(isvc, p).extensions.stepTimeoutGraceSeconds
    assert 0 < grace < budget
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["NPUSERVE_CPU_BINDING"] == "numa"
    assert env["LD_PRELOAD"].endswith("libjemalloc.so.2") and "background_thread:true" in env["MALLOC_CONF"]
    mounts = {m["name"]: m for m in engine["volumeMounts"]}
    assert mounts["model"]["subPath"] == "Meta-Llama-3-8B-Instruct" and mounts["model"]["readOnly"]
    assert mounts["config"]["mountPath"] == "/etc/npuserve" and "subPath" not in mounts["config"]  # live updates


def test_engine_is_locked_down_and_only_the_opt_in_init_containers_are_privileged() -> None:
    isvc, p = load("llama3-70b-multinode.yaml")  # THP and governor both on
    lws = by_kind(r.render(isvc, p))["LeaderWorkerSet"]
    for template in ("leaderTemplate", "workerTemplate"):
        pod = pod_spec(lws, template)
        (engine,) = pod["containers"]
        sc = engine["securityContext"]
        assert sc["runAsNonRoot"] and sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert any(v["name"] == "tmp" and "emptyDir" in v for v in pod["volumes"])
        init = {c["name"]: c for c in pod["initContainers"]}
        assert set(init) == {"transparent-hugepages", "cpu-performance-governor"}
        assert "transparent_hugepage/enabled" in init["transparent-hugepages"]["command"][-1]
        assert "scaling_governor" in init["cpu-performance-governor"]["command"][-1]
        for c in init.values():
            assert c["securityContext"]["privileged"] is True
            assert c["resources"]["requests"] == c["resources"]["limits"]  # keeps the pod Guaranteed


def test_host_tuning_is_off_when_not_asked() -> None:
    isvc, p = load("qwq-32b-first-token.yaml")
    pod = pod_spec(by_kind(r.render(isvc, p))["Deployment"])
    assert "initContainers" not in pod
    isvc, p = load("tiny-cpu.yaml")
    pod = pod_spec(by_kind(r.render(isvc, p))["Deployment"])
    (engine,) = pod["containers"]
    env = {e["name"] for e in engine["env"]}
    assert "LD_PRELOAD" not in env
    assert "cpu" not in engine["resources"]["limits"]  # cpuPinning none: no CPU limit, no throttling
    assert not any("/" in k for k in engine["resources"]["requests"])  # no extended resource on the CPU


def test_multi_node_renders_a_leaderworkerset_and_the_service_selects_leaders() -> None:
    isvc, p = load("llama3-70b-multinode.yaml")
    objects = by_kind(r.render(isvc, p))
    lws = objects["LeaderWorkerSet"]
    template = lws["spec"]["leaderWorkerTemplate"]
    assert (template["size"], lws["spec"]["replicas"]) == (2, 1)
    assert (template["restartPolicy"], lws["spec"]["startupPolicy"]) == ("RecreateGroupOnPodRestart", "LeaderCreated")
    # The Service `llama3-70b` is the InferenceService's: each group gets its own headless Service for its names.
    assert objects["Service"]["metadata"]["name"] == lws["metadata"]["name"]
    assert lws["spec"]["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    (leader,) = pod_spec(lws, "leaderTemplate")["containers"]
    (worker,) = pod_spec(lws, "workerTemplate")["containers"]
    # Every pod of the group runs `npuserve serve` with the group's flags, from the controller's variables.
    command = ["npuserve", "serve", "--model", "/models", "--config", "/etc/npuserve/config.json", "--host", "0.0.0.0",
               "--port", "8000", "--nnodes", "$(LWS_GROUP_SIZE)", "--node-rank", "$(LWS_WORKER_INDEX)",
               "--master-addr", "$(LWS_LEADER_ADDRESS)", "--master-port", "29500"]
    assert leader["command"] == worker["command"] == command
    # The leader serves HTTP and the rendezvous; a worker serves /health and /ready on the same port, named so that
    # no scrape of `http` (the chart's PodMonitor) reaches it.
    assert leader["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"},
                               {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"}]
    assert worker["ports"] == [{"name": "health", "containerPort": 8000, "protocol": "TCP"}]
    for engine, port in ((leader, "http"), (worker, "health")):
        assert engine["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
        assert engine["livenessProbe"]["httpGet"] == engine["startupProbe"]["httpGet"] == {"path": "/health",
                                                                                           "port": port}
    assert worker["resources"]["limits"]["huawei.com/Ascend910"] == "8"
    assert objects["Service"]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert objects["PodMonitor"]["spec"]["selector"]["matchLabels"] == objects["Service"]["spec"]["selector"]
    config = MindIEConfig.from_dict(json.loads(objects["ConfigMap"]["data"]["config.json"]))
    assert config.BackendConfig.multiNodesInferEnabled and config.model.worldSize == 16
    assert config.BackendConfig.npuDeviceIds == [list(range(8))]


GROUP_ANTI_AFFINITY = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
    "labelSelector": {
        "matchLabels": {"npuserve.io/inferenceservice": "llama3-70b", "app.kubernetes.io/component": "engine"}},
    "matchLabelKeys": ["leaderworkerset.sigs.k8s.io/group-key"],
    "topologyKey": "kubernetes.io/hostname"}]}}


def test_a_groups_pods_go_one_per_node() -> None:
    isvc, p = load("llama3-70b-multinode.yaml")
    lws = by_kind(r.render(isvc, p))["LeaderWorkerSet"]
    for template in ("leaderTemplate", "workerTemplate"):
        assert pod_spec(lws, template)["affinity"] == GROUP_ANTI_AFFINITY
    isvc, p = load("llama3-8b-throughput.yaml")  # one pod per replica: no rule
    assert "affinity" not in pod_spec(by_kind(r.render(isvc, p))["Deployment"])


def test_the_group_rule_is_added_to_an_affinity_already_there() -> None:
    node_affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    other = {"labelSelector": {"matchLabels": {"app": "x"}}, "topologyKey": "zone"}
    pod: dict[str, Any] = {"affinity": {**node_affinity, "podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [other]}}}
    r.merge_affinity(pod, GROUP_ANTI_AFFINITY)
    (group_term,) = GROUP_ANTI_AFFINITY["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert pod["affinity"] == {**node_affinity, "podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [other, group_term]}}


def test_a_cpu_replica_split_by_cards_per_node_is_a_group_of_one_card_pods() -> None:
    """The e2e test's spec: two CPU ranks, one per pod, in a LeaderWorkerSet of two."""
    isvc, p = load("tiny-cpu.yaml", accelerator={"type": "cpu", "cards": 2, "cardsPerNode": 1, "memoryGiB": 2,
                                                 "reservedGiB": 0})
    objects = by_kind(r.render(isvc, p))
    assert "Deployment" not in objects
    lws = objects["LeaderWorkerSet"]
    validate(lws)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    for template in ("leaderTemplate", "workerTemplate"):
        engine, pod = _engine(isvc, p, template)
        assert engine["command"][-8:] == ["--nnodes", "$(LWS_GROUP_SIZE)", "--node-rank", "$(LWS_WORKER_INDEX)",
                                          "--master-addr", "$(LWS_LEADER_ADDRESS)", "--master-port", "29500"]
        assert not {"HCCL_IF_IP", "HCCL_CONNECT_TIMEOUT", "GLOO_SOCKET_IFNAME"} & set(_env(engine))
        assert not any("/" in k for k in engine["resources"]["limits"])  # no accelerator resource on the CPU
        assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0][
            "matchLabelKeys"] == ["leaderworkerset.sigs.k8s.io/group-key"]
    config = json.loads(objects["ConfigMap"]["data"]["config.json"])
    assert config["BackendConfig"]["multiNodesInferEnabled"] is True
    assert config["BackendConfig"]["npuDeviceIds"] == [[0]]  # one rank per pod
    assert config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["worldSize"] == 2


def test_podmonitor_is_optional() -> None:
    isvc, p = load("qwq-32b-first-token.yaml")
    assert "PodMonitor" not in by_kind(r.render(isvc, p))
    isvc, p = load("llama3-8b-throughput.yaml")
    pm = by_kind(r.render(isvc, p))["PodMonitor"]
    assert pm["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert pm["spec"]["podTargetLabels"] == ["npuserve.io/inferenceservice"]


def _hash(isvc: InferenceService, p: Plan) -> str:
    deployment = by_kind(r.render(isvc, p))["Deployment"]
    annotations: dict[str, str] = deployment["spec"]["template"]["metadata"]["annotations"]
    return annotations[r.CONFIG_HASH_ANNOTATION]


def test_config_hash_rolls_pods_on_memory_changes_not_on_live_schedule_changes() -> None:
    isvc, p = load("llama3-8b-throughput.yaml")
    base = _hash(isvc, p)
    tuned = p.model_copy(update={"schedule": p.schedule.model_copy(update={"maxBatchSize": 300,
                                                                           "maxPrefillBatchSize": 150})})
    assert _hash(isvc, tuned) == base
    assert _hash(isvc, p.model_copy(update={"npuMemSizeGiB": 16})) != base
    assert _hash(isvc, p.model_copy(update={"cpuMemSizeGiB": 6})) != base
    block = p.model_copy(update={"schedule": p.schedule.model_copy(update={"cacheBlockSize": 64})})
    assert _hash(isvc, block) != base


def test_the_schedule_generation_is_in_config_json_and_never_rolls_the_pods() -> None:
    isvc, p = load("llama3-8b-throughput.yaml")
    rendered = {g: by_kind(r.render(isvc, p, None, g)) for g in (3, 4)}
    for g, objects in rendered.items():
        assert json.loads(objects["ConfigMap"]["data"][r.CONFIG_KEY])["npuserve"]["scheduleGeneration"] == g
    hashes = {g: o["Deployment"]["spec"]["template"]["metadata"]["annotations"][r.CONFIG_HASH_ANNOTATION]
              for g, o in rendered.items()}
    assert hashes[3] == hashes[4] == _hash(isvc, p)


def test_dummy_weights_ship_the_architecture_in_the_configmap() -> None:
    isvc, p = load("tiny-cpu.yaml")
    objects = by_kind(r.render(isvc, p))
    hf = json.loads(objects["ConfigMap"]["data"][r.MODEL_CONFIG_KEY])
    assert hf["num_hidden_layers"] == 2 and hf["model_type"] == "llama"
    (engine,) = pod_spec(objects["Deployment"])["containers"]
    assert engine["command"][3] == "/etc/npuserve/model"
    config_volume = next(v for v in pod_spec(objects["Deployment"])["volumes"] if v["name"] == "config")
    assert {"key": r.MODEL_CONFIG_KEY, "path": "model/config.json"} in config_volume["configMap"]["items"]


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-deepseek-v2-lite"])
def test_dummy_weights_of_an_inline_moe_architecture_ship_its_experts_and_latent(preset: str) -> None:
    """The inline MoE/MLA fields reach the engine: the ConfigMap's config.json parses back to the same experts,
    dense layers and latent sizes (the router's grouping is the model type's default, not an API field)."""
    from npuserve.catalog.models import get_model_preset
    from npuserve.modelspec import ModelSpec
    from npuserve.planning.planner import architecture_of

    preset_spec = get_model_preset(preset)
    data = load_yaml(REPO / "examples" / "tiny-cpu.yaml")
    data["spec"]["model"].pop("preset")
    data["spec"]["model"]["architecture"] = architecture_of(preset_spec).model_dump(exclude_none=True)
    isvc = InferenceService.model_validate(data)
    objects = by_kind(r.render(isvc, plan(isvc.spec)))
    served = ModelSpec.from_hf_config(json.loads(objects["ConfigMap"]["data"][r.MODEL_CONFIG_KEY]))
    assert served.moe is not None and preset_spec.moe is not None
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "norm_topk_prob", "scoring_func", "topk_method"):
        assert getattr(served.moe, field) == getattr(preset_spec.moe, field), field
    assert served.moe_layers == preset_spec.moe_layers
    assert served.mla == preset_spec.mla
    assert served.num_parameters == preset_spec.num_parameters


def test_owner_reference_when_the_object_has_a_uid() -> None:
    data = load_yaml(REPO / "examples" / "qwq-32b-first-token.yaml")
    data["metadata"].update(uid="1234", namespace="serving")
    isvc = InferenceService.model_validate(data)
    for obj in r.render(isvc, plan(isvc.spec)):
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner == {"apiVersion": "npuserve.io/v1alpha1", "kind": "InferenceService", "name": "qwq-32b",
                         "uid": "1234", "controller": True, "blockOwnerDeletion": True}
        assert obj["metadata"]["namespace"] == "serving"


def test_selector_matches_the_pod_labels() -> None:
    isvc, p = load("qwq-32b-first-token.yaml")
    deployment = by_kind(r.render(isvc, p))["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for pair in r.selector(isvc).split(","):
        key, value = pair.split("=")
        assert pod_labels[key] == value
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


# --- what each tensor-parallel rank needs ---------------------------------------------------------------------------


def _engine(isvc: InferenceService, p: Plan, template: str = "template") -> tuple[dict[str, Any], dict[str, Any]]:
    objects = by_kind(r.render(isvc, p))
    pod = pod_spec(objects.get("Deployment") or objects["LeaderWorkerSet"], template)
    (engine,) = pod["containers"]
    return engine, pod


def _env(engine: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in engine["env"]}


def _shm(pod: dict[str, Any]) -> dict[str, Any]:
    (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    return dict(shm["emptyDir"])


VISIBLE_DEVICE_VARIABLES = ("ASCEND_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
                            "NVIDIA_VISIBLE_DEVICES")


def test_two_ascend_ranks_get_their_cards_hccl_settings_cores_and_shared_memory() -> None:
    isvc, p = load("llama3-8b-throughput.yaml")  # worldSize 2 on one node: two ranks in one pod
    engine, pod = _engine(isvc, p)
    res = engine["resources"]
    # the cards: the device plugin picks them; the ranks number them 0..1 (config.json), nothing is forced
    assert res["limits"]["huawei.com/Ascend910"] == "2"
    config = MindIEConfig.from_dict(json.loads(by_kind(r.render(isvc, p))["ConfigMap"]["data"]["config.json"]))
    assert config.BackendConfig.npuDeviceIds == [[0, 1]] and config.model.worldSize == 2
    env = _env(engine)
    assert not set(VISIBLE_DEVICE_VARIABLES) & set(env)
    # HCCL: the link-up waits as long as the startup probe lets the pod load (10 s x 180), within CANN's 120..7200
    assert env["HCCL_CONNECT_TIMEOUT"] == "1800"
    assert engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"] == 1800
    assert not {"HCCL_IF_IP", "HCCL_EXEC_TIMEOUT", "HCCL_BUFFSIZE", "HCCL_OP_EXPANSION_MODE"} & set(env)
    # cores: 8 per rank, exclusive, and each rank binds itself to its share (engine/affinity.py)
    assert res["requests"]["cpu"] == res["limits"]["cpu"] == "16" and env["NPUSERVE_CPU_BINDING"] == "numa"
    assert "OMP_NUM_THREADS" not in env
    # /dev/shm: 1 GiB + 1 GiB per rank, memory-backed, so counted in the memory limit: by hand, weights 14.958 GiB
    # + swap 5 GiB x 2 cards + 16 GiB overhead = 40.958 -> 41, + 2 GiB for the second rank, + 3 GiB of shm = 46
    assert _shm(pod) == {"medium": "Memory", "sizeLimit": "3Gi"}
    assert res["requests"]["memory"] == res["limits"]["memory"] == "46Gi"
    assert r.engine_memory_gib(isvc, p) == 46 and r.shm_size_gib(p) == 3 and r.ranks_per_pod(p) == 2


def test_one_rank_needs_no_collective_settings() -> None:
    isvc, p = load("qwen2.5-7b-decode-latency.yaml")  # one card
    engine, pod = _engine(isvc, p)
    env = _env(engine)
    assert not [name for name in env if name.startswith(("HCCL_", "NCCL_"))] and "OMP_NUM_THREADS" not in env
    assert _shm(pod)["sizeLimit"] == "2Gi"
    # weights 14.185 + swap 5 + overhead 16 = 35.185 -> 36, no further rank, + 2 GiB of shm
    assert engine["resources"]["limits"]["memory"] == "38Gi"


def test_cuda_ranks_get_their_gpus_and_no_hccl() -> None:
    isvc, p = load("llama3-8b-throughput.yaml", accelerator={"type": "nvidia-h100-80gb", "cards": 4})
    engine, pod = _engine(isvc, p)
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert engine["resources"]["requests"]["cpu"] == "32"
    env = _env(engine)
    assert not [name for name in env if name.startswith(("HCCL_", "NCCL_", "ASCEND_"))]
    assert not set(VISIBLE_DEVICE_VARIABLES) & set(env)
    assert _shm(pod)["sizeLimit"] == "5Gi"
    validate(by_kind(r.render(isvc, p))["Deployment"])


def test_unpinned_ranks_get_no_thread_count_from_the_operator() -> None:
    """The engine sizes each rank's threads (engine/affinity.py `rank_threads`), from the container's budget."""
    isvc, p = load("llama3-8b-throughput.yaml", host={"cpuPinning": "none"})
    engine, _ = _engine(isvc, p)
    assert "OMP_NUM_THREADS" not in _env(engine)
    assert "cpu" not in engine["resources"]["limits"]


def test_a_memory_set_in_the_spec_is_the_pods_whole_memory() -> None:
    isvc, p = load("llama3-8b-throughput.yaml", engine={"memoryGiB": 64})
    engine, pod = _engine(isvc, p)
    assert engine["resources"]["requests"]["memory"] == engine["resources"]["limits"]["memory"] == "64Gi"
    assert _shm(pod)["sizeLimit"] == "3Gi"  # within it


def test_multi_node_pods_carry_the_rank_settings_in_leader_and_worker() -> None:
    isvc, p = load("llama3-70b-multinode.yaml")  # 16 cards: two pods of 8 ranks
    assert (p.nodes, p.cardsPerPod) == (2, 8)
    # the largest all-reduce: a prefill of 8192 tokens x hidden size 8192 x 2 bytes (bf16) = 128 MiB, under 200
    assert p.schedule.maxPrefillTokens == 8192 and r.hccl_buffsize_mb(isvc, p) == 200
    for template in ("leaderTemplate", "workerTemplate"):
        engine, pod = _engine(isvc, p, template)
        env = _env(engine)
        assert env["HCCL_CONNECT_TIMEOUT"] == "1800"
        assert env["HCCL_IF_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["HCCL_EXEC_TIMEOUT"] == "300"  # the engine's step timeout, not CANN's 1836
        assert env["HCCL_BUFFSIZE"] == "200"  # 128 MB fit CANN's default buffer, which it never goes below
        assert not {"HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NPUSERVE_NNODES", "NPUSERVE_NODE_RANK"} & set(env)
        assert not set(VISIBLE_DEVICE_VARIABLES) & set(env)
        assert engine["resources"]["limits"]["huawei.com/Ascend910"] == "8"
        assert engine["resources"]["limits"]["cpu"] == "64"
        assert _shm(pod)["sizeLimit"] == "9Gi"
        # weights 131.417 / 2 + swap 5 x 8 + 16 = 121.7 -> 122, + 2 x 7 further ranks, + 9 GiB of shm
        assert engine["resources"]["limits"]["memory"] == "145Gi"


def test_a_long_prefill_raises_hccl_buffsize_to_hold_its_all_reduce() -> None:
    isvc, p = load("llama3-70b-multinode.yaml", engine={"schedule": {"maxPrefillTokens": 16384}})
    assert p.schedule.maxPrefillTokens == 16384
    engine, _ = _engine(isvc, p, "leaderTemplate")
    assert _env(engine)["HCCL_BUFFSIZE"] == "256"  # 16384 x 8192 x 2 bytes = 256 MiB


def test_one_pod_of_ascend_ranks_keeps_canns_exec_timeout_and_buffer() -> None:
    isvc, p = load("llama3-8b-throughput.yaml")
    env = _env(_engine(isvc, p)[0])
    assert env["HCCL_CONNECT_TIMEOUT"] == "1800"
    assert not {"HCCL_IF_IP", "HCCL_EXEC_TIMEOUT", "HCCL_BUFFSIZE", "HCCL_SOCKET_IFNAME"} & set(env)


@pytest.mark.parametrize(("example", "changes", "expected", "absent"), [
    ("llama3-70b-multinode.yaml", {}, {"HCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1"},
     {"HCCL_IF_IP", "NCCL_SOCKET_IFNAME"}),  # HCCL_IF_IP would take precedence over the named interface
    ("llama3-70b-multinode.yaml", {"accelerator": {"type": "nvidia-h100-80gb", "cards": 16}},
     {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1"}, {"HCCL_SOCKET_IFNAME", "HCCL_IF_IP"}),
    ("tiny-cpu.yaml", {"accelerator": {"type": "cpu", "cards": 2, "cardsPerNode": 1, "memoryGiB": 2,
                                       "reservedGiB": 0}},
     {"GLOO_SOCKET_IFNAME": "eth1"}, {"HCCL_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"}),
])
def test_a_named_interface_goes_to_each_library_of_the_device(example: str, changes: dict[str, Any],
                                                               expected: dict[str, str], absent: set[str]) -> None:
    data = load_yaml(REPO / "examples" / example)
    data["spec"].update(changes)
    data["spec"].setdefault("engine", {})["socketInterface"] = "eth1"
    isvc = InferenceService.model_validate(data)
    p = plan(isvc.spec)
    assert p.nodes == 2
    for template in ("leaderTemplate", "workerTemplate"):
        env = _env(_engine(isvc, p, template)[0])
        assert {k: env.get(k) for k in expected} == expected and not absent & set(env)


def test_hccl_connect_timeout_stays_within_canns_range() -> None:
    assert r.HCCL_CONNECT_TIMEOUT_RANGE_S == (120, 7200)
    assert 120 <= r.hccl_connect_timeout_s() <= 7200
