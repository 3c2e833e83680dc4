"""Pods from a plan (docs/planning.md#pods). Pure: InferenceService + Plan -> Kubernetes manifests as dicts.

Objects: the ConfigMap holding MindIE's `config.json`, a Deployment (or a LeaderWorkerSet when one replica's cards
span nodes), a Service, and optionally a PodMonitor. The host tuning of the guide is rendered as the spec asks:
CPU pinning (integer CPU requests equal to limits, so the kubelet's static CPU manager gives exclusive cores, and
`NPUSERVE_CPU_BINDING=numa`, which tells the engine to bind itself at start-up to one NUMA node's cores among its
exclusive ones, as the guide's `taskset` does); transparent huge pages and the CPU performance governor, each from
its own privileged init container and opt-in because each changes the whole node; jemalloc through `LD_PRELOAD`.
The engine container itself runs as a non-root user, without privilege escalation or capabilities, on a read-only
root filesystem. The engine's port, flags and environment names come from `npuserve.engine_contract`.

Tensor parallel runs within one pod: one engine process (rank) per card of the pod, `npuserve serve` being rank 0.
What the ranks need is rendered per pod (`ranks_per_pod`): the cards (the accelerator resource, which the device
plugin makes visible as 0..n-1, and config.json's `npuDeviceIds` [[0..n-1]]; no visible-devices variable is forced),
CPUS_PER_CARD exclusive cores per rank (each rank binds to its share, engine/affinity.py), host memory per further
rank, a /dev/shm sized by the ranks and counted in the memory limit, and the HCCL settings of `rank_env`. A replica
whose cards span nodes is a LeaderWorkerSet group of `plan.nodes` pods, one per node (`render_leaderworkerset`): every
pod runs `npuserve serve` with the group's flags (`engine_contract.group_serve_args`, from the variables the
LeaderWorkerSet controller sets); the leader (node rank 0) serves HTTP and listens on the rendezvous port, the workers
serve /health and /ready only.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from npuserve.bench_contract import bench_command
from npuserve.catalog.accelerators import get_accelerator
from npuserve.engine_contract import (
    ADMIN_TOKEN_ENV,
    CPU_BINDING_ENV,
    DEFAULT_STEP_TIMEOUT_S,
    DEFAULT_TERMINATION_LOG,
    DTYPE_BYTES,
    ENGINE_PORT,
    HEALTH_PATH,
    HOT_SCHEDULE_FIELDS,
    LIVENESS_FAILURE_THRESHOLD,
    LIVENESS_PERIOD_S,
    METRICS_PATH,
    NPU_MEMORY_FRACTION_ENV,
    READY_PATH,
    RENDEZVOUS_PORT,
    RENDEZVOUS_PORT_NAME,
    SCHEDULE_GENERATION_KEY,
    group_serve_args,
    serve_command,
)
from npuserve.mindie_config import MindIEConfig, NpuserveExtensions
from npuserve.planning.api import API_VERSION, KIND, InferenceService, Plan, PlanSchedule
from npuserve.planning.planner import model_spec
from npuserve.planning.problem import max_batch_size_limit

from .names import COMPONENT_LABEL, ENGINE_CONTAINER, INSTANCE_LABEL, LWS_GROUP_KEY_LABEL, LWS_WORKER_INDEX_LABEL

# --- the pod's file layout (the engine's port, flags and environment names are the contract's) ------------------

PORT_NAME = "http"
# A LeaderWorkerSet worker's name for the same port: it answers /health and /ready only, so it is not named `http`,
# which the chart's PodMonitor and the operator's scrape for /metrics.
WORKER_PORT_NAME = "health"
CONFIG_DIR = "/etc/npuserve"
CONFIG_KEY = "config.json"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
MODEL_CONFIG_KEY = "model-config.json"  # loadFormat dummy: the architecture's HF config.json, no weights
DUMMY_MODEL_DIR = f"{CONFIG_DIR}/model"
MODEL_DIR = "/models"
TMP_DIR = "/tmp"
# The engine image provides libjemalloc at this path (deploy/docker links the distribution's library here).
JEMALLOC_PATH = "/usr/local/lib/libjemalloc.so.2"
MALLOC_CONF = "background_thread:true,metadata_thp:auto,dirty_decay_ms:30000,muzzy_decay_ms:30000"
ENGINE_UID = 1000  # HwHiAiUser on Ascend hosts, the owner of the driver's device files
CONFIG_HASH_ANNOTATION = "npuserve.io/config-hash"
ADMIN_TOKEN_KEY = "token"  # the key of the admin Secret (PUT /admin/schedule's bearer token)
LOADGEN_COMPONENT = "loadgen"
BENCH_GRACE_S = 120  # a benchmark Job's run past its load, before Kubernetes ends it
CPUS_PER_CARD = 8
MIN_CPUS = 4
HOST_MEMORY_OVERHEAD_GIB = 16
# Each rank beyond the first is a process of its own: Python, torch (0.5 GiB resident after `import torch` on the CPU,
# measured), the host side of its device runtime (CUDA context, CANN's ACL) and its allocator's pinned staging.
RANK_HOST_MEMORY_GIB = 2
# /dev/shm (a memory-backed emptyDir). Docker's 64 MiB default is what breaks NCCL between processes of one
# container; what the ranks put there: NCCL's SHM transport (when cards lack peer-to-peer access: per channel and
# ring neighbour, NCCL_BUFFSIZE of 4 MiB per protocol, about 0.3 GiB per rank at 16 channels), the semaphores and
# tensors torch.multiprocessing shares between the engine's processes. HCCL moves data card to card (HCCS), not
# through the host, and the step messages go over gloo's TCP on the loopback, so 1 GiB per rank is ample; the base
# is for the engine process's own use whatever the card count.
SHM_BASE_GIB = 1
SHM_PER_RANK_GIB = 1
# The engine's startup probe: loading weights may take this long before /health answers.
STARTUP_PROBE_PERIOD_S = 10
STARTUP_PROBE_FAILURES = 180
# HCCL (Ascend's collectives, CANN's environment variables). HCCL_CONNECT_TIMEOUT bounds how long a rank waits for
# its peers while the communicator links up (CANN: 120 s by default, 120..7200): torch creates the communicator at
# the first collective, which can come after each rank has loaded its slice of the weights, so a rank on slow storage
# can trail the others by minutes. It is set to the time the startup probe gives the pod to load, within CANN's range.
HCCL_CONNECT_TIMEOUT_ENV = "HCCL_CONNECT_TIMEOUT"
HCCL_CONNECT_TIMEOUT_RANGE_S = (120, 7200)
# The host address HCCL's control sockets use between pods (multi-node only): the pod's own IP, unless the spec names
# an interface (HCCL_SOCKET_IFNAME), which HCCL_IF_IP would override (CANN: HCCL_IF_IP takes precedence).
HCCL_IF_IP_ENV = "HCCL_IF_IP"
# The interface of the sockets between pods, where spec.engine.socketInterface names one: HCCL's on Ascend, NCCL's
# on CUDA, and gloo's (torch.distributed's CPU group, which carries the engine's step messages) on every device.
HCCL_SOCKET_IFNAME_ENV = "HCCL_SOCKET_IFNAME"
NCCL_SOCKET_IFNAME_ENV = "NCCL_SOCKET_IFNAME"
GLOO_SOCKET_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
# How long a rank waits in a collective for a peer that does not join (CANN: 1836 s by default). Between pods a peer
# that is gone would hold the group's cards for half an hour; no legitimate wait in a collective is longer than the
# slowest step, which the engine's step watchdog bounds (npuserve.stepTimeoutSeconds), so it is set to that.
HCCL_EXEC_TIMEOUT_ENV = "HCCL_EXEC_TIMEOUT"
# The buffer (MB, CANN's default 200) each HCCL communicator holds per peer on every card; a collective larger than it
# runs in several rounds. Between pods the largest one is a prefill's all-reduce of maxPrefillTokens x hiddenSize
# activations, so it is raised to hold that (at least CANN's default).
HCCL_BUFFSIZE_ENV = "HCCL_BUFFSIZE"
HCCL_BUFFSIZE_DEFAULT_MB = 200
# The node label the scheduler spreads a group's pods over: one pod per node, as a replica spanning nodes means.
HOSTNAME_TOPOLOGY_KEY = "kubernetes.io/hostname"
Manifest = dict[str, Any]


def model_path(isvc: InferenceService) -> str:
    return DUMMY_MODEL_DIR if isvc.spec.model.weights.loadFormat == "dummy" else MODEL_DIR


def labels(isvc: InferenceService) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "npuserve-engine",
        "app.kubernetes.io/instance": isvc.metadata.name,
        "app.kubernetes.io/managed-by": "npuserve-operator",
        COMPONENT_LABEL: "engine",
        INSTANCE_LABEL: isvc.metadata.name,
    }


def selector_labels(isvc: InferenceService) -> dict[str, str]:
    return {INSTANCE_LABEL: isvc.metadata.name, COMPONENT_LABEL: "engine"}


def selector(isvc: InferenceService) -> str:
    """`status.selector` for the scale subresource."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(isvc).items())


def config_map_name(isvc: InferenceService) -> str:
    return f"{isvc.metadata.name}-config"


def admin_secret_name(isvc: InferenceService) -> str:
    return f"{isvc.metadata.name}-admin"


def _metadata(isvc: InferenceService, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": isvc.metadata.namespace, "labels": labels(isvc)}
    if isvc.metadata.uid:
        meta["ownerReferences"] = [
            {"apiVersion": API_VERSION, "kind": KIND, "name": isvc.metadata.name, "uid": isvc.metadata.uid,
             "controller": True, "blockOwnerDeletion": True}
        ]
    return meta


# --- config.json -------------------------------------------------------------------------------------------------


def mindie_config(isvc: InferenceService, plan: Plan, schedule: PlanSchedule | None = None,
                  generation: int | None = None) -> MindIEConfig:
    """MindIE's config.json of the plan; `schedule` (the tuner's, when it has applied one) replaces the plan's;
    `generation`: its schedule generation (`tuning_schedule.configmap_schedule`), which the engines compare.
    `npuserve.maxBatchSizeLimit` is the plan's, not the schedule's: it sizes the engine at start-up (so it is in
    the config hash), and every maxBatchSize the tuner proposes is within it, applied live."""
    spec = isvc.spec
    acc = get_accelerator(spec.accelerator.type)
    data = {
        "Version": "1.0.0",
        "ServerConfig": {"ipAddress": "0.0.0.0", "port": ENGINE_PORT, "httpsEnabled": False,
                         "allowAllZeroIpListening": True},
        "BackendConfig": {
            "npuDeviceIds": [list(range(plan.cardsPerPod))],
            "multiNodesInferEnabled": plan.nodes > 1,
            "ModelDeployConfig": {
                "maxSeqLen": plan.maxSeqLen,
                "maxInputTokenLen": plan.maxInputTokenLen,
                "truncation": False,
                "ModelConfig": [
                    {
                        "modelName": spec.model.name,
                        "modelWeightPath": model_path(isvc),
                        "worldSize": plan.worldSize,
                        "cpuMemSize": plan.cpuMemSizeGiB,
                        "npuMemSize": plan.npuMemSizeGiB,
                    }
                ],
            },
            # exclude_none: a tuned schedule's unset inner-loop fields (tuning_schedule.ConfigSchedule) stay out.
            "ScheduleConfig": (schedule or plan.schedule).model_dump(exclude_none=True),
        },
        "npuserve": NpuserveExtensions(
            device=acc.npu_device_type,
            dtype=model_spec(spec).dtype,
            loadFormat=spec.model.weights.loadFormat,
            quantization=spec.model.quantization,
            policy=spec.engine.policy,
            servedModelName=spec.model.name,
            maxBatchSizeLimit=max_batch_size_limit(plan),
            scheduleGeneration=generation,
        ).model_dump(exclude_defaults=False),
    }
    return MindIEConfig.from_dict(data, source=f"{isvc.metadata.name} config.json")


def config_hash(config: MindIEConfig, model_config: str | None = None) -> str:
    """Hash of what needs a restart to change: everything but the live schedule fields and their generation."""
    data = config.to_dict()
    schedule = data["BackendConfig"].get("ScheduleConfig", {})
    data["BackendConfig"]["ScheduleConfig"] = {k: v for k, v in schedule.items() if k not in HOT_SCHEDULE_FIELDS}
    data.get("npuserve", {}).pop(SCHEDULE_GENERATION_KEY, None)
    text = json.dumps(data, sort_keys=True) + (model_config or "")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _model_config_json(isvc: InferenceService) -> str | None:
    if isvc.spec.model.weights.loadFormat != "dummy":
        return None
    return json.dumps(model_spec(isvc.spec).to_hf_config(), indent=2, sort_keys=True) + "\n"


def render_configmap(isvc: InferenceService, plan: Plan, schedule: PlanSchedule | None = None,
                     generation: int | None = None) -> Manifest:
    data = {CONFIG_KEY: mindie_config(isvc, plan, schedule, generation).dumps()}
    model_config = _model_config_json(isvc)
    if model_config is not None:
        data[MODEL_CONFIG_KEY] = model_config
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(isvc, config_map_name(isvc)),
            "data": data}


# --- pods --------------------------------------------------------------------------------------------------------


def ranks_per_pod(plan: Plan) -> int:
    """Engine processes in one pod: one tensor-parallel rank per card of the pod (`npuserve serve` is rank 0 and starts
    the others); rank r drives the pod's r-th card."""
    return plan.cardsPerPod


def engine_cpus(isvc: InferenceService, plan: Plan) -> int:
    """Whole CPUs per engine pod: spec.engine.cpu, else CPUS_PER_CARD per card (per rank), at least MIN_CPUS."""
    return isvc.spec.engine.cpu or max(MIN_CPUS, CPUS_PER_CARD * plan.cardsPerPod)


def shm_size_gib(plan: Plan) -> int:
    """The size limit of the pod's /dev/shm: SHM_BASE_GIB + SHM_PER_RANK_GIB per rank."""
    return SHM_BASE_GIB + SHM_PER_RANK_GIB * ranks_per_pod(plan)


def engine_memory_gib(isvc: InferenceService, plan: Plan) -> int:
    """Host memory per engine pod (requests = limits): spec.engine.memoryGiB, else the weights the pod loads, the swap
    space of each card (cpuMemSize), the KV cache when it lives in host memory (the CPU backend), a base overhead, one
    per further rank, and /dev/shm: a memory-backed emptyDir's files count against the pod's memory limit, so its
    size limit is added rather than left to push the engine into the OOM killer."""
    spec = isvc.spec
    if spec.engine.memoryGiB is not None:
        return spec.engine.memoryGiB
    memory = math.ceil(plan.weightsGiB / plan.nodes + plan.cpuMemSizeGiB * plan.cardsPerPod + HOST_MEMORY_OVERHEAD_GIB)
    if get_accelerator(spec.accelerator.type).resource_name is None:  # the CPU backend's KV cache is in host memory
        memory += plan.npuMemSizeGiB * plan.cardsPerPod
    return memory + RANK_HOST_MEMORY_GIB * (ranks_per_pod(plan) - 1) + shm_size_gib(plan)


def _resources(isvc: InferenceService, plan: Plan) -> dict[str, Any]:
    spec = isvc.spec
    acc = get_accelerator(spec.accelerator.type)
    cpus = engine_cpus(isvc, plan)
    memory = engine_memory_gib(isvc, plan)
    requests: dict[str, str] = {"cpu": str(cpus), "memory": f"{memory}Gi"}
    limits: dict[str, str] = {"memory": f"{memory}Gi"}
    if spec.host.cpuPinning == "numa":
        limits["cpu"] = str(cpus)  # integer and equal to the request: exclusive cores from the static CPU manager
    if acc.resource_name is not None:
        # The cards: the device plugin picks which physical ones and makes them visible to the container (Ascend:
        # ASCEND_VISIBLE_DEVICES and the /dev/davinci nodes; NVIDIA: the container's GPUs), numbered 0..n-1 inside;
        # config.json's npuDeviceIds [[0..n-1]] are those numbers, one per rank.
        requests[acc.resource_name] = str(plan.cardsPerPod)
        limits[acc.resource_name] = str(plan.cardsPerPod)
    return {"requests": requests, "limits": limits}


def hccl_connect_timeout_s() -> int:
    """HCCL_CONNECT_TIMEOUT: the startup probe's budget (the time the pod has to load), within CANN's range."""
    lo, hi = HCCL_CONNECT_TIMEOUT_RANGE_S
    return min(hi, max(lo, STARTUP_PROBE_PERIOD_S * STARTUP_PROBE_FAILURES))


def hccl_buffsize_mb(isvc: InferenceService, plan: Plan) -> int:
    """HCCL_BUFFSIZE of a replica spanning nodes: the largest step's all-reduce (a prefill of the plan's
    maxPrefillTokens, hiddenSize activations each, in the model's dtype), in MB, at least CANN's default."""
    model = model_spec(isvc.spec)
    largest = plan.schedule.maxPrefillTokens * model.hidden_size * DTYPE_BYTES[model.dtype]
    return max(HCCL_BUFFSIZE_DEFAULT_MB, math.ceil(largest / 2**20))


def rank_env(isvc: InferenceService, plan: Plan) -> list[dict[str, Any]]:
    """What the ranks of one pod need in their environment beyond one process's (none for worldSize 1 in one pod).

    On Ascend with worldSize > 1: HCCL_CONNECT_TIMEOUT. Between pods (a replica spanning nodes), on Ascend: HCCL_IF_IP
    from the pod's IP (or HCCL_SOCKET_IFNAME where spec.engine.socketInterface names the interface), HCCL_EXEC_TIMEOUT
    and HCCL_BUFFSIZE (the constants above say why each value); on CUDA, NCCL_SOCKET_IFNAME where an interface is named;
    GLOO_SOCKET_IFNAME on every device where one is named. docs/operator.md cites CANN's documentation of each.

    Not set on purpose: ASCEND_RT_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES (the device plugin decides which physical
    cards the pod gets and exposes only those; each rank selects its card by its rank among them, so forcing a list
    here could name cards the pod does not have); the rendezvous address (127.0.0.1 inside one pod; the leader's
    address from the LeaderWorkerSet controller between pods, passed as a flag); NCCL's other variables (its defaults
    suit one node; it needs /dev/shm, which the pod has, see shm_size_gib); within one pod, HCCL_EXEC_TIMEOUT and
    HCCL_BUFFSIZE (CANN's defaults: the ranks of one pod live and die together, and a prefill of 8192 tokens of hidden
    size 8192 in bf16 is 128 MiB, within the 200 MB buffer); HCCL_OP_EXPANSION_MODE=AIV (faster all-reduce on Atlas A2
    for inference only, not on the 300I Duo, and not with several communicators at once).
    """
    spec = isvc.spec
    device = get_accelerator(spec.accelerator.type).npu_device_type
    interface = spec.engine.socketInterface
    env: list[dict[str, Any]] = []
    if plan.worldSize > 1 and device == "npu":
        env.append({"name": HCCL_CONNECT_TIMEOUT_ENV, "value": str(hccl_connect_timeout_s())})
        if plan.nodes > 1:
            if interface:
                env.append({"name": HCCL_SOCKET_IFNAME_ENV, "value": interface})
            else:
                env.append({"name": HCCL_IF_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
            env.append({"name": HCCL_EXEC_TIMEOUT_ENV, "value": str(int(DEFAULT_STEP_TIMEOUT_S))})
            env.append({"name": HCCL_BUFFSIZE_ENV, "value": str(hccl_buffsize_mb(isvc, plan))})
    if interface:
        if device == "cuda":
            env.append({"name": NCCL_SOCKET_IFNAME_ENV, "value": interface})
        env.append({"name": GLOO_SOCKET_IFNAME_ENV, "value": interface})
    return env


def _env(isvc: InferenceService, plan: Plan) -> list[dict[str, Any]]:
    spec = isvc.spec
    acc = get_accelerator(spec.accelerator.type)
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": TMP_DIR},
        {"name": CPU_BINDING_ENV, "value": spec.host.cpuPinning},
        {"name": NPU_MEMORY_FRACTION_ENV, "value": str(spec.accelerator.memoryFraction)},
        {"name": ADMIN_TOKEN_ENV,
         "valueFrom": {"secretKeyRef": {"name": admin_secret_name(isvc), "key": ADMIN_TOKEN_KEY, "optional": True}}},
    ]
    if acc.npu_device_type == "npu":
        env.append({"name": "ASCEND_PROCESS_LOG_PATH", "value": f"{TMP_DIR}/ascend/log"})
    if spec.host.jemalloc:
        env += [{"name": "LD_PRELOAD", "value": JEMALLOC_PATH}, {"name": "MALLOC_CONF", "value": MALLOC_CONF}]
    env += rank_env(isvc, plan)
    return env


def _probe(path: str, period: int, failures: int, port: str = PORT_NAME) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "timeoutSeconds": 5,
            "failureThreshold": failures}


def _model_mounts(isvc: InferenceService) -> list[dict[str, Any]]:
    """The weights folder (a PVC or a hostPath) at MODEL_DIR; none for random weights."""
    weights = isvc.spec.model.weights
    if weights.pvc is None and weights.hostPath is None:
        return []
    mount: dict[str, Any] = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
    if weights.pvc is not None and weights.pvc.subPath:
        mount["subPath"] = weights.pvc.subPath
    return [mount]


def _model_volumes(isvc: InferenceService) -> list[dict[str, Any]]:
    weights = isvc.spec.model.weights
    if weights.pvc is not None:
        return [{"name": "model", "persistentVolumeClaim": {"claimName": weights.pvc.claimName, "readOnly": True}}]
    if weights.hostPath is not None:
        return [{"name": "model", "hostPath": {"path": weights.hostPath.path, "type": "Directory"}}]
    return []


def _engine_container(isvc: InferenceService, plan: Plan, leader: bool) -> dict[str, Any]:
    spec = isvc.spec
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": TMP_DIR},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    mounts += _model_mounts(isvc)
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.imagePullPolicy,
        "command": serve_command(model_path(isvc), CONFIG_PATH) + (group_serve_args() if plan.nodes > 1 else []),
        # A fatal engine error writes its message here (docs/engine.md#errors-and-health); an engine that stops
        # without one (on npu, `npuserve doctor`'s failed checks at start-up) leaves its last log lines instead. The
        # operator shows it in the Ready condition and `kubectl describe` in the pod.
        "terminationMessagePath": DEFAULT_TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "env": _env(isvc, plan),
        "resources": _resources(isvc, plan),
        "volumeMounts": mounts,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ENGINE_UID,
            "runAsGroup": ENGINE_UID,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    # Every pod answers /health and /ready on the engine's port, a group's workers too (they serve nothing else, so
    # their port has another name: no scrape of /metrics reaches them).
    port = PORT_NAME if leader else WORKER_PORT_NAME
    container["ports"] = [{"name": port, "containerPort": ENGINE_PORT, "protocol": "TCP"}]
    if leader and plan.nodes > 1:
        # The group's other pods connect here to form the ranks' world (torch.distributed's rendezvous).
        container["ports"].append({"name": RENDEZVOUS_PORT_NAME, "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"})
    # Loading weights can take many minutes; the startup probe holds liveness off until /health answers.
    container["startupProbe"] = _probe(HEALTH_PATH, STARTUP_PROBE_PERIOD_S, STARTUP_PROBE_FAILURES, port)
    # /health fails once a step is stuck past npuserve.stepTimeoutSeconds; the engine exits by itself within
    # this budget (its grace is one period shorter), the kubelet restarts it at the latest when it runs out.
    container["livenessProbe"] = _probe(HEALTH_PATH, LIVENESS_PERIOD_S, LIVENESS_FAILURE_THRESHOLD, port)
    container["readinessProbe"] = _probe(READY_PATH, 5, 3, port)
    return container


def _privileged_init(isvc: InferenceService, name: str, script: str) -> dict[str, Any]:
    return {
        "name": name,
        "image": isvc.spec.engine.image,
        "imagePullPolicy": isvc.spec.engine.imagePullPolicy,
        "command": ["sh", "-c", script],
        # Equal requests and limits keep the pod in the Guaranteed QoS class that exclusive cores need.
        "resources": {"requests": {"cpu": "1", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "64Mi"}},
        "securityContext": {"privileged": True, "runAsUser": 0, "runAsNonRoot": False},
    }


THP_SCRIPT = "echo always > /sys/kernel/mm/transparent_hugepage/enabled"
GOVERNOR_SCRIPT = (
    'for g in /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor; do [ -w "$g" ] && echo performance > "$g"; '
    "done; true"
)


def _pod_template(isvc: InferenceService, plan: Plan, config_digest: str, leader: bool) -> dict[str, Any]:
    spec = isvc.spec
    init: list[dict[str, Any]] = []
    if spec.host.transparentHugePages:
        init.append(_privileged_init(isvc, "transparent-hugepages", THP_SCRIPT))
    if spec.host.cpuPerformanceGovernor:
        init.append(_privileged_init(isvc, "cpu-performance-governor", GOVERNOR_SCRIPT))
    items = [{"key": CONFIG_KEY, "path": CONFIG_KEY}]
    if spec.model.weights.loadFormat == "dummy":
        items.append({"key": MODEL_CONFIG_KEY, "path": "model/config.json"})
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(isvc), "items": items}},
        {"name": "tmp", "emptyDir": {}},
        # Counted in the engine's memory request and limit (engine_memory_gib).
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_size_gib(plan)}Gi"}},
    ]
    volumes += _model_volumes(isvc)
    annotations = {CONFIG_HASH_ANNOTATION: config_digest}
    if leader:
        annotations.update({"prometheus.io/scrape": "true", "prometheus.io/port": str(ENGINE_PORT),
                            "prometheus.io/path": METRICS_PATH})
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": {
            "fsGroup": ENGINE_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_engine_container(isvc, plan, leader)],
        "volumes": volumes,
    }
    if init:
        pod["initContainers"] = init
    if spec.engine.nodeSelector:
        pod["nodeSelector"] = dict(spec.engine.nodeSelector)
    if spec.engine.tolerations:
        pod["tolerations"] = [t.model_dump(exclude_none=True) for t in spec.engine.tolerations]
    if plan.nodes > 1:
        merge_affinity(pod, group_anti_affinity(isvc))
    return {"metadata": {"labels": labels(isvc), "annotations": annotations}, "spec": pod}


def group_anti_affinity(isvc: InferenceService) -> dict[str, Any]:
    """One pod of a LeaderWorkerSet group per node (required): the engine pods of this InferenceService, narrowed by
    `matchLabelKeys` to those with the pod's own group key (which the controller's webhook sets on a group's leader and
    workers alike, before the API server merges the key into the selector), over kubernetes.io/hostname. The key may
    not also appear in the selector (the API server refuses the pod). An API server without matchLabelKeys (before
    Kubernetes 1.29, or with MatchLabelKeysInPodAffinity off) drops it, and the rule keeps any two engine pods of this
    InferenceService apart: stricter, never looser."""
    term = {
        "labelSelector": {"matchLabels": selector_labels(isvc)},
        "matchLabelKeys": [LWS_GROUP_KEY_LABEL],
        "topologyKey": HOSTNAME_TOPOLOGY_KEY,
    }
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}


def merge_affinity(pod: dict[str, Any], extra: dict[str, Any]) -> None:
    """Adds `extra`'s terms to the pod's affinity: each required or preferred list is extended, nothing replaced."""
    affinity = pod.setdefault("affinity", {})
    for kind, rules in extra.items():
        mine = affinity.setdefault(kind, {})
        for when, terms in rules.items():
            mine.setdefault(when, []).extend(terms)


def render_deployment(isvc: InferenceService, plan: Plan, config_digest: str) -> Manifest:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(isvc, isvc.metadata.name),
        "spec": {
            "replicas": plan.replicas,
            "selector": {"matchLabels": selector_labels(isvc)},
            # Cards are scarce: replace a pod in place rather than ask for a surge pod's cards.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": _pod_template(isvc, plan, config_digest, leader=True),
        },
    }


def render_leaderworkerset(isvc: InferenceService, plan: Plan, config_digest: str) -> Manifest:
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": _metadata(isvc, isvc.metadata.name),
        "spec": {
            "replicas": plan.replicas,
            "startupPolicy": "LeaderCreated",
            # The InferenceService's own Service is named `<name>`, the name the controller's shared headless Service
            # would take (it leaves an existing Service alone, and then no pod name resolves): one headless Service
            # per group, named after its leader `<name>-<group>`, gives the leader `<name>-<g>.<name>-<g>.<ns>`.
            "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},
            "leaderWorkerTemplate": {
                "size": plan.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _pod_template(isvc, plan, config_digest, leader=True),
                "workerTemplate": _pod_template(isvc, plan, config_digest, leader=False),
            },
        },
    }


def _serving_selector(isvc: InferenceService, plan: Plan) -> dict[str, str]:
    chosen = selector_labels(isvc)
    if plan.nodes > 1:
        chosen[LWS_WORKER_INDEX_LABEL] = "0"  # only the leader of each group serves HTTP
    return chosen


def render_service(isvc: InferenceService, plan: Plan) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(isvc, isvc.metadata.name),
        "spec": {
            "type": "ClusterIP",
            "selector": _serving_selector(isvc, plan),
            "ports": [{"name": PORT_NAME, "port": ENGINE_PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def render_podmonitor(isvc: InferenceService, plan: Plan) -> Manifest:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _metadata(isvc, isvc.metadata.name),
        "spec": {
            "selector": {"matchLabels": _serving_selector(isvc, plan)},
            # Series carry `npuserve_io_inferenceservice`, as from the chart's monitor: the operator's Prometheus
            # client selects an InferenceService's series by it (operator/prometheus.py).
            "podTargetLabels": [INSTANCE_LABEL],
            "podMetricsEndpoints": [
                {"port": PORT_NAME, "path": METRICS_PATH, "interval": isvc.spec.monitoring.interval}
            ],
        },
    }


def render(isvc: InferenceService, plan: Plan, schedule: PlanSchedule | None = None,
           generation: int | None = None) -> list[Manifest]:
    """Every object of one InferenceService, in apply order. `schedule`: the tuner's, in the ConfigMap, at its
    `generation`; the pod template's config hash leaves the hot schedule fields and the generation out, so a tuned
    schedule never rolls the pods."""
    configmap = render_configmap(isvc, plan, schedule, generation)
    digest = config_hash(mindie_config(isvc, plan, schedule, generation), configmap["data"].get(MODEL_CONFIG_KEY))
    workload = (
        render_leaderworkerset(isvc, plan, digest) if plan.nodes > 1 else render_deployment(isvc, plan, digest)
    )
    objects = [configmap, workload, render_service(isvc, plan)]
    if isvc.spec.monitoring.podMonitor:
        objects.append(render_podmonitor(isvc, plan))
    return objects


# --- the admin Secret and the benchmark Jobs (autotune) ----------------------------------------------------------


def render_admin_secret(isvc: InferenceService, token: str) -> Manifest:
    """The bearer token of the engines' PUT /admin/schedule: the operator creates it once (a random token) and
    never rewrites it; the pods read it from their environment."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _metadata(isvc, admin_secret_name(isvc)), "stringData": {ADMIN_TOKEN_KEY: token}}


def bench_job_name(isvc: InferenceService, kind: str, round_: int, number: int, at: float) -> str:
    """`<name>-b<round>t<trial>-<5 digits of the start time>` (`c<probe>` for a capacity probe): a new name for each
    window, so a Job still being deleted never blocks the next; at most 63 characters, as the Job controller's
    job-name label requires (names are at most 45)."""
    return f"{isvc.metadata.name}-b{round_}{'t' if kind == 'trial' else 'c'}{number}-{int(at) % 100000:05d}"


def render_bench_job(isvc: InferenceService, *, name: str, target_ip: str, concurrency: int,
                     duration_s: float) -> Manifest:
    """The load-generator Job of one benchmark trial: `npuserve bench` in the engine image against one engine pod
    (the instance whose window is measured), the workload's lengths, closed loop at `concurrency` users, for
    `duration_s`; it measures nothing itself that the operator reads: the engine's metrics in Prometheus do."""
    spec = isvc.spec
    w = spec.workload
    # The model's own tokenizer, so the prompts have the workload's lengths in its tokens (random weights ship none:
    # then the load generator's word-count estimate).
    model_mounts = _model_mounts(isvc)
    command = bench_command(
        base_url=f"http://{target_ip}:{ENGINE_PORT}", model=spec.model.name, input_len=w.avgInputTokens,
        output_len=w.avgOutputTokens, concurrency=concurrency, duration_s=duration_s,
        num_prompts=max(100, concurrency * 4), request_timeout_s=duration_s + BENCH_GRACE_S,
        tokenizer=MODEL_DIR if model_mounts else None)
    meta = _metadata(isvc, name)
    meta["labels"] = {**meta["labels"], COMPONENT_LABEL: LOADGEN_COMPONENT}
    pod_labels = {INSTANCE_LABEL: isvc.metadata.name, COMPONENT_LABEL: LOADGEN_COMPONENT}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": math.ceil(duration_s) + BENCH_GRACE_S,
            "ttlSecondsAfterFinished": 600,
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{
                        "name": "bench",
                        "image": spec.engine.image,
                        "imagePullPolicy": spec.engine.imagePullPolicy,
                        "command": command,
                        "env": [{"name": "HOME", "value": TMP_DIR}],
                        "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                                      "limits": {"cpu": "2", "memory": "2Gi"}},
                        "volumeMounts": [{"name": "tmp", "mountPath": TMP_DIR}, *model_mounts],
                        "securityContext": {
                            "runAsNonRoot": True, "runAsUser": ENGINE_UID, "runAsGroup": ENGINE_UID,
                            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]},
                        },
                    }],
                    "volumes": [{"name": "tmp", "emptyDir": {}}, *_model_volumes(isvc)],
                    **({"nodeSelector": dict(spec.engine.nodeSelector)} if spec.engine.nodeSelector else {}),
                    **({"tolerations": [t.model_dump(exclude_none=True) for t in spec.engine.tolerations]}
                       if spec.engine.tolerations else {}),
                },
            },
        },
    }
