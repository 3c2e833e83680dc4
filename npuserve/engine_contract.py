"""The operator-engine contract: everything the renderer writes and the engine reads, defined once
(docs/architecture.md#contracts-npuserve).

The operator (`npuserve.operator.render`, `kube`) and the engine (`npuserve.engine.server`, `affinity`, `runner`)
both import this module; neither spells a port, a flag, an environment name, a ScheduleConfig range or the KV
block formula on its own. It imports neither of them (nor torch), so the operator image installs without the
engine.

What lives here:
- the HTTP port and the `npuserve serve` command line the renderer passes;
- the environment variables (admin token, CPU binding, NUMA node, multi-node layout, MindIE's own variables);
- the termination-message path, the liveness probe's numbers and the step watchdog's defaults that fit them;
- the ScheduleConfig field table: each field's type, MindIE default, range, and whether the engine applies it live
  (`hot`) or needs a restart. Every schema of ScheduleConfig (MindIE's `config.json`, the CRD's
  `spec.engine.schedule`, the plan, `PUT /admin/schedule`) takes its ranges from `schedule_field()`;
- the `/info` response model the engine serves and the operator reads;
- the Prometheus metric names the engine exports and the operator queries;
- the queue-policy names, the dtype table and the KV bytes-per-block formula;
- what the engine can serve today (devices), which the operator checks before it deploys pods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

# --- HTTP and the command line -------------------------------------------------------------------------------------

ENGINE_PORT = 8000
DEFAULT_HOST = "0.0.0.0"
INFO_PATH = "/info"
READY_PATH = "/ready"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
ADMIN_SCHEDULE_PATH = "/admin/schedule"

# The `npuserve serve` flags the renderer passes; `serve_cli.configure` declares them under the same names.
FLAG_MODEL = "--model"
FLAG_CONFIG = "--config"
FLAG_HOST = "--host"
FLAG_PORT = "--port"


def serve_command(model_path: str, config_path: str, host: str = DEFAULT_HOST, port: int = ENGINE_PORT) -> list[str]:
    """The engine container's command: `npuserve serve` on a MindIE config.json."""
    return ["npuserve", "serve", FLAG_MODEL, model_path, FLAG_CONFIG, config_path, FLAG_HOST, host,
            FLAG_PORT, str(port)]


# --- a replica whose ranks span pods (a LeaderWorkerSet group, docs/engine.md#tensor-parallel-across-pods) ---------
# The pod with node rank k runs ranks k*cardsPerPod .. (k+1)*cardsPerPod-1. The flags are named as vLLM's multi-node
# serving (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`); a pod of node rank > 0 is headless (health
# only, as vLLM's `--headless`). The leader (node rank 0) listens on the rendezvous port; each other pod's first rank
# connects there, and the ranks then form the torch.distributed world (gloo, nccl or hccl) through it.
FLAG_NNODES = "--nnodes"
FLAG_NODE_RANK = "--node-rank"
FLAG_MASTER_ADDR = "--master-addr"
FLAG_MASTER_PORT = "--master-port"
FLAG_GROUP_CONNECT_TIMEOUT = "--group-connect-timeout"
RENDEZVOUS_PORT = 29500  # torch.distributed's MASTER_PORT default
RENDEZVOUS_PORT_NAME = "rendezvous"
# How long the leader waits for every other pod of its group (and a pod for its leader) before it exits naming the
# one missing: a pod that was scheduled but never starts must not hold the group's cards forever.
DEFAULT_GROUP_CONNECT_TIMEOUT_S = 600.0
# Set by the LeaderWorkerSet controller's pod webhook in every container of a group (sigs.k8s.io/lws
# pkg/utils/pod/pod_utils.go): `<lws>-<group>.<lws>.<namespace>`, the group's size in pods, the pod's index (0: leader).
LWS_LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
LWS_GROUP_SIZE_ENV = "LWS_GROUP_SIZE"
LWS_WORKER_INDEX_ENV = "LWS_WORKER_INDEX"


def group_serve_args() -> list[str]:
    """The flags that make `npuserve serve` one pod of a LeaderWorkerSet group: the controller's variables, expanded
    by the kubelet (`$(VAR)` in a container's args)."""
    return [FLAG_NNODES, f"$({LWS_GROUP_SIZE_ENV})", FLAG_NODE_RANK, f"$({LWS_WORKER_INDEX_ENV})",
            FLAG_MASTER_ADDR, f"$({LWS_LEADER_ADDRESS_ENV})", FLAG_MASTER_PORT, str(RENDEZVOUS_PORT)]


# --- environment ---------------------------------------------------------------------------------------------------

ADMIN_TOKEN_ENV = "NPUSERVE_ADMIN_TOKEN"  # bearer token of PUT /admin/schedule; unset: the admin API is off
CPU_BINDING_ENV = "NPUSERVE_CPU_BINDING"  # "numa": bind to the NUMA node of the pod's cards at start-up
NUMA_NODE_ENV = "NPUSERVE_NUMA_NODE"  # the NUMA node to bind to; unset: the node holding most of the pod's cores
# MindIE's own variables (read by `mindie_config.EngineEnvironment`); the newer recompute name wins when both are set.
RECOMPUTE_THRESHOLD_ENVS = ("MINDIE_LLM_RECOMPUTE_THRESHOLD", "MIES_RECOMPUTE_THRESHOLD")
USE_MB_SWAPPER_ENV = "MIES_USE_MB_SWAPPER"
NPU_MEMORY_FRACTION_ENV = "NPU_MEMORY_FRACTION"

CpuBinding = Literal["numa", "none"]
CPU_BINDINGS: tuple[str, ...] = get_args(CpuBinding)

# --- failing loudly: the termination message, the step watchdog, the liveness probe (docs/engine.md#errors-and-health)
# Where the engine writes its last fatal message (the kubelet shows it as the container's termination message, and
# the operator as the InferenceService's Ready condition). Unset: the kubelet's default path, written only when it
# exists (in a pod the kubelet creates it; on a workstation nothing is written under /dev).
TERMINATION_LOG_ENV = "NPUSERVE_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
# The engine container's liveness probe on /health: the kubelet restarts the container after this many failures
# this many seconds apart. /health fails once the step watchdog finds a stuck step; the engine then exits by itself
# after a grace of one period less than the probe's budget, so the message the pod records is the engine's own.
LIVENESS_PERIOD_S = 10
LIVENESS_FAILURE_THRESHOLD = 3
LIVENESS_BUDGET_S = LIVENESS_PERIOD_S * LIVENESS_FAILURE_THRESHOLD
DEFAULT_STEP_TIMEOUT_GRACE_S = LIVENESS_BUDGET_S - LIVENESS_PERIOD_S
# No step may take longer: far above the slowest legitimate one (a prefill of the largest maxPrefillTokens, which
# takes seconds to tens of seconds on a card), far below "never".
DEFAULT_STEP_TIMEOUT_S = 300

# --- names shared by the CRD, config.json and the engine -----------------------------------------------------------

QueuePolicy = Literal["fcfs", "priority", "longest-output-first"]
QUEUE_POLICIES: tuple[str, ...] = get_args(QueuePolicy)

DType = Literal["bfloat16", "float16", "float32"]
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

Device = Literal["npu", "cuda", "cpu"]

# What the bundled engine runs today. The operator refuses to deploy anything else (a condition says why) instead
# of rendering pods that would crash; the engine refuses it at start-up with the same words. A replica whose ranks
# span pods is served (the flags above), so the layout is no reason: only the device is.
SERVABLE_DEVICES: frozenset[str] = frozenset({"cpu", "cuda", "npu"})
UNSERVABLE_REASON = f"it has backends for {', '.join(sorted(SERVABLE_DEVICES))} only"


def unservable(device: str, world_size: int, nodes: int = 1) -> str | None:
    """Why the engine cannot serve this layout, or None when it can. Tensor parallel runs within one pod (one process
    per rank) and across the pods of a LeaderWorkerSet group, so `world_size` and `nodes` (kept for callers that pass
    them) refuse nothing; a device without a backend does."""
    del world_size, nodes
    if device not in SERVABLE_DEVICES:
        return f"the bundled engine cannot serve device {device!r}: {UNSERVABLE_REASON}"
    return None


def kv_bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str,
                       world_size: int = 1) -> int:
    """`2 x layers x block_size x kv_heads_per_card x head_dim x dtype_bytes` (docs/engine.md#the-kv-cache): the KV
    heads are split over the cards, and replicated when there are fewer KV heads than cards."""
    kv_heads_per_card = max(1, num_kv_heads // world_size)
    return 2 * num_layers * block_size * kv_heads_per_card * head_dim * DTYPE_BYTES[dtype]


def mla_kv_bytes_per_block(*, num_layers: int, block_size: int, kv_lora_rank: int, rope_dim: int, dtype: str) -> int:
    """`layers x block_size x (kv_lora_rank + rope_dim) x dtype_bytes` for latent attention: one normed latent and
    one rope key per token, shared by all heads, so every tensor-parallel card holds the whole of it (no split)."""
    return num_layers * block_size * (kv_lora_rank + rope_dim) * DTYPE_BYTES[dtype]


# --- ScheduleConfig: one field table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleField:
    """One MindIE ScheduleConfig field: its type, MindIE's shipped default, its range, and how it takes effect."""

    name: str
    type: type
    default: int | bool
    hot: bool  # applied live (PUT /admin/schedule, a config file change); else the pods restart for it
    description: str
    ge: int | None = None
    le: int | None = None
    knob: bool = True  # settable in the CRD's spec.engine.schedule (and so by the tuner, unless pinned)


SCHEDULE_FIELDS: tuple[ScheduleField, ...] = (
    ScheduleField("cacheBlockSize", int, 128, False, "tokens per KV block; sizes the KV pool", 1, 1024),
    ScheduleField("maxPrefillBatchSize", int, 50, True, "requests in one prefill step; 0 = maxBatchSize", 0, 5000),
    ScheduleField("maxPrefillTokens", int, 8192, True, "prompt tokens in one prefill step", 1, 409600),
    ScheduleField("prefillTimeMsPerReq", int, 150, True,
                  "supportSelectBatch: estimated prefill cost per running request, ms", 0, 1000),
    ScheduleField("prefillPolicyType", int, 0, True,
                  "MindIE's prefill queue policy; only 0 (FCFS) runs here: the waiting order is npuserve.policy",
                  0, 0, knob=False),
    ScheduleField("decodeTimeMsPerReq", int, 50, True,
                  "supportSelectBatch: estimated decode cost per empty batch slot, ms", 0, 1000),
    ScheduleField("decodePolicyType", int, 0, True, "MindIE's decode queue policy; only 0 (FCFS) runs here",
                  0, 0, knob=False),
    ScheduleField("maxBatchSize", int, 200, True, "requests running at once (the decode batch)", 1, 5000),
    ScheduleField("maxIterTimes", int, 512, True, "output tokens per request at most", 1, None, knob=False),
    ScheduleField("maxPreemptCount", int, 0, True, "requests swapped to host memory in one step at most", 0, 5000),
    ScheduleField("supportSelectBatch", bool, False, True,
                  "MindIE's throughput policy: weigh prefill cost against idle decode slots"),
    ScheduleField("maxQueueDelayMicroseconds", int, 5000, True,
                  "how long the oldest waiting request may wait before a prefill starts", 500, 1_000_000),
    # MindIE 2.3's SLO scheduling (docs/mindie-config.md, "SLO scheduling"). Not tuner knobs: the controller is the
    # engine's own loop, and the tuner's maxBatchSize is its upper bound.
    ScheduleField("stageSelectPolicy", int, 0, True,
                  "MindIE's prefill-or-decode choice; only 0 (prefill first, MindIE's default) runs here",
                  0, 0, knob=False),
    ScheduleField("dynamicBatchSizeEnable", bool, False, True,
                  "hold the mean TPOT at decodeExpectedTime by capping the running batch below maxBatchSize",
                  knob=False),
    ScheduleField("decodeExpectedTime", int, 50, True,
                  "dynamicBatchSizeEnable: the TPOT the running batch cap holds, ms", 1, 10000, knob=False),
)
SCHEDULE_FIELD_BY_NAME: dict[str, ScheduleField] = {f.name: f for f in SCHEDULE_FIELDS}
HOT_SCHEDULE_FIELDS: frozenset[str] = frozenset(f.name for f in SCHEDULE_FIELDS if f.hot)
RESTART_SCHEDULE_FIELDS: frozenset[str] = frozenset(f.name for f in SCHEDULE_FIELDS if not f.hot)
SCHEDULE_KNOBS: tuple[str, ...] = tuple(f.name for f in SCHEDULE_FIELDS if f.knob)


# The schedule generation: which schedule the operator's writers (PUT /admin/schedule, the ConfigMap) mean, one
# number rising with each schedule the operator decides. The engine applies a schedule only when its generation is
# newer than the one it runs, from either path, so a stale writer (an old ConfigMap the kubelet delivers late) never
# replaces a newer schedule. The same key names it in config.json's `npuserve` section, in the PUT body and in /info.
SCHEDULE_GENERATION_KEY = "scheduleGeneration"


def schedule_generation_field(*, required: bool = False) -> Any:
    """The pydantic `Field` of the schedule generation, wherever it is carried (unset: no generation, as in a
    hand-written config.json: such an engine takes any schedule, and refuses an ungenerated one once it runs one)."""
    description = ("the schedule's generation: applied only when newer than the one the engine runs (docs/engine.md, "
                   "\"Live configuration\")")
    if required:
        return Field(ge=0, description=description)
    return Field(default=None, ge=0, description=description)


def schedule_field(name: str, *, required: bool = False, optional: bool = False) -> Any:
    """The pydantic `Field` of a ScheduleConfig field, from the table: MindIE's default (or None when `optional`,
    or no default when `required`), its range and its description. Every ScheduleConfig schema uses it."""
    spec = SCHEDULE_FIELD_BY_NAME[name]
    kwargs: dict[str, Any] = {"description": spec.description}
    if spec.ge is not None:
        kwargs["ge"] = spec.ge
    if spec.le is not None:
        kwargs["le"] = spec.le
    if required:
        return Field(**kwargs)
    return Field(default=None if optional else spec.default, **kwargs)


# --- Prometheus metric names ---------------------------------------------------------------------------------------
# The engine registers these at `GET /metrics` (vLLM's names, prefix `npuserve:`, docs/engine.md#metrics); the
# operator's Prometheus client queries them and the Helm chart's dashboard charts them. Keep them exactly as written:
# renaming one breaks every Prometheus query and dashboard that users already have.

MetricKind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class EngineMetric:
    """One engine metric: the name the engine registers with prometheus_client, and the series Prometheus stores."""

    name: str
    kind: MetricKind

    @property
    def series(self) -> str:
        """The exported series of a counter or a gauge: prometheus_client appends `_total` to a counter's name."""
        if self.kind == "histogram":
            raise ValueError(f"{self.name} is a histogram: use .bucket, .sum_series or .count_series")
        return self.name + "_total" if self.kind == "counter" else self.name

    def _histogram(self, suffix: str) -> str:
        if self.kind != "histogram":
            raise ValueError(f"{self.name} is a {self.kind}, not a histogram")
        return f"{self.name}_{suffix}"

    @property
    def bucket(self) -> str:
        return self._histogram("bucket")

    @property
    def sum_series(self) -> str:
        return self._histogram("sum")

    @property
    def count_series(self) -> str:
        return self._histogram("count")


METRIC_TIME_TO_FIRST_TOKEN = EngineMetric("npuserve:time_to_first_token_seconds", "histogram")
METRIC_TIME_PER_OUTPUT_TOKEN = EngineMetric("npuserve:time_per_output_token_seconds", "histogram")
METRIC_INTER_TOKEN_LATENCY = EngineMetric("npuserve:inter_token_latency_seconds", "histogram")
METRIC_E2E_REQUEST_LATENCY = EngineMetric("npuserve:e2e_request_latency_seconds", "histogram")
METRIC_REQUEST_QUEUE_TIME = EngineMetric("npuserve:request_queue_time_seconds", "histogram")
METRIC_REQUEST_PREFILL_TIME = EngineMetric("npuserve:request_prefill_time_seconds", "histogram")
METRIC_REQUEST_DECODE_TIME = EngineMetric("npuserve:request_decode_time_seconds", "histogram")
METRIC_PREFILL_BATCH_SIZE = EngineMetric("npuserve:prefill_batch_size", "histogram")
METRIC_DECODE_BATCH_SIZE = EngineMetric("npuserve:decode_batch_size", "histogram")
METRIC_NUM_REQUESTS_RUNNING = EngineMetric("npuserve:num_requests_running", "gauge")
METRIC_NUM_REQUESTS_WAITING = EngineMetric("npuserve:num_requests_waiting", "gauge")
METRIC_NUM_REQUESTS_SWAPPED = EngineMetric("npuserve:num_requests_swapped", "gauge")
METRIC_KV_CACHE_USAGE_PERC = EngineMetric("npuserve:kv_cache_usage_perc", "gauge")  # 0-1, despite the name
METRIC_KV_CACHE_BLOCKS_TOTAL = EngineMetric("npuserve:kv_cache_blocks_total", "gauge")
METRIC_PROMPT_TOKENS = EngineMetric("npuserve:prompt_tokens", "counter")
METRIC_GENERATION_TOKENS = EngineMetric("npuserve:generation_tokens", "counter")
METRIC_NUM_PREEMPTIONS = EngineMetric("npuserve:num_preemptions", "counter")
METRIC_REQUEST_SUCCESS = EngineMetric("npuserve:request_success", "counter")  # every finished request, by reason
# The schedule generation the engine runs (-1: none); the operator checks min and max over a trial's window.
METRIC_SCHEDULE_GENERATION = EngineMetric("npuserve:schedule_generation", "gauge")
SCHEDULE_GENERATION_NONE = -1
# The running batch cap in force: maxBatchSize, or the TPOT controller's cap under it (dynamicBatchSizeEnable).
METRIC_BATCH_SIZE_CAP = EngineMetric("npuserve:batch_size_cap", "gauge")
ENGINE_METRICS: tuple[EngineMetric, ...] = (
    METRIC_TIME_TO_FIRST_TOKEN, METRIC_TIME_PER_OUTPUT_TOKEN, METRIC_INTER_TOKEN_LATENCY, METRIC_E2E_REQUEST_LATENCY,
    METRIC_REQUEST_QUEUE_TIME, METRIC_REQUEST_PREFILL_TIME, METRIC_REQUEST_DECODE_TIME, METRIC_PREFILL_BATCH_SIZE,
    METRIC_DECODE_BATCH_SIZE, METRIC_NUM_REQUESTS_RUNNING, METRIC_NUM_REQUESTS_WAITING, METRIC_NUM_REQUESTS_SWAPPED,
    METRIC_KV_CACHE_USAGE_PERC, METRIC_KV_CACHE_BLOCKS_TOTAL, METRIC_PROMPT_TOKENS, METRIC_GENERATION_TOKENS,
    METRIC_NUM_PREEMPTIONS, METRIC_REQUEST_SUCCESS, METRIC_SCHEDULE_GENERATION, METRIC_BATCH_SIZE_CAP,
)

# The labels the engine puts on every series, and on request_success.
METRIC_LABEL_MODEL = "model_name"
METRIC_LABEL_FINISHED_REASON = "finished_reason"
# A finished request's reason (the engine's FinishReason values). `abort` is a client that went away, not an error.
FINISHED_REASON_STOP = "stop"
FINISHED_REASON_LENGTH = "length"
FINISHED_REASON_ABORT = "abort"
FINISHED_REASON_ERROR = "error"
FINISHED_REASONS: tuple[str, ...] = (FINISHED_REASON_STOP, FINISHED_REASON_LENGTH, FINISHED_REASON_ABORT,
                                     FINISHED_REASON_ERROR)


# --- /info ----------------------------------------------------------------------------------------------------------


class RankInfo(BaseModel):
    """One tensor-parallel rank, as `/info` reports it: where it runs and the KV blocks its own memory held before the
    ranks agreed on the smallest."""

    rank: int
    node_rank: int = Field(description="the pod of the replica it runs in (the LeaderWorkerSet worker index)")
    host: str = Field(description="that pod's host name")
    kv_blocks: int
    kv_host_blocks: int


class EngineInfo(BaseModel):
    """`GET /info`: what the engine actually runs. The operator reads `kv_blocks` into status.observed."""

    model_config = ConfigDict(extra="allow")  # an older operator reads a newer engine

    model: str
    model_type: str
    dtype: str
    device: str
    worldSize: int
    nodes: int = Field(default=1, description="pods the ranks span (1: all in this one)")
    ranks: list[RankInfo] = Field(default_factory=list, description="every rank of the replica, leader's first")
    kv_blocks: int = Field(description="KV blocks allocated per card")
    kv_host_blocks: int
    block_size: int
    kv_bytes_per_block: int
    kv_sizing: str = Field(description="how kv_blocks was chosen")
    schedule: dict[str, Any] = Field(description="the ScheduleConfig the scheduler runs now")
    graph_batch_sizes: list[int] = Field(
        default_factory=list, description="decode batch sizes captured as graphs (a decode batch replays the "
        "smallest that holds it, up to the largest; past it decode runs eagerly); empty on a backend without graphs")
    scheduleGeneration: int | None = schedule_generation_field()  # of that schedule
    batch_size_cap: int | None = Field(
        default=None, description="the running batch cap in force: schedule.maxBatchSize, or below it the cap the "
        "TPOT controller set (dynamicBatchSizeEnable); no new request is admitted while this many run")
    quantization: str | None = Field(default=None, description="the quantized scheme served (QuantScheme.name, "
                                     "e.g. 'msmodelslim W8A8_DYNAMIC'); None: the weights in `dtype`")
    # The HTTP server's side (absent offline, from `npuserve generate`).
    served_model_name: str | None = None
    version: str | None = None
    ready: bool | None = None
    max_waiting_requests: int | None = None
    num_requests_in_flight: int | None = None


# --- per-request timings: what the engine reports of each request, what the load generator reads -------------------

# Name of the field that carries a request's RequestTimings on the last streamed chunk and on a whole response.
TIMINGS_FIELD = "npuserve"

# The TGI `/generate` timing headers (milliseconds, except the two token counts). The seeds' perf scheme reads
# first-token latency as prefill + queue time, decode latency as time per token, response time as inference time.
HEADER_PROMPT_TOKENS = "x-prompt-tokens"
HEADER_GENERATED_TOKENS = "x-generated-tokens"
HEADER_QUEUE_TIME = "x-queue-time"
HEADER_PREFILL_TIME = "x-prefill-time"
HEADER_INFERENCE_TIME = "x-inference-time"
HEADER_TIME_PER_TOKEN = "x-time-per-token"


class RequestTimings(BaseModel):
    """Per-request timings the load generator turns into MindIE's PrefillBatchsize, DecoderBatchsize and
    QueueWaitTime columns (docs/engine.md#http-api). Milliseconds."""

    queue_time_ms: float | None = None
    prefill_time_ms: float | None = None
    ttft_ms: float | None = None
    decode_time_ms: float | None = None
    e2e_ms: float | None = None
    prefill_batch_size: int = 0
    mean_decode_batch_size: float | None = None
    num_preemptions: int = 0

    @classmethod
    def from_engine(cls, metrics: dict[str, float]) -> RequestTimings:
        def ms(key: str) -> float | None:
            return None if key not in metrics else round(metrics[key] * 1000.0, 3)

        return cls(
            queue_time_ms=ms("queue_time"), prefill_time_ms=ms("prefill_time"), ttft_ms=ms("ttft"),
            decode_time_ms=ms("decode_time"), e2e_ms=ms("e2e"),
            prefill_batch_size=int(metrics.get("prefill_batch_size", 0)),
            mean_decode_batch_size=metrics.get("mean_decode_batch_size"),
            num_preemptions=int(metrics.get("num_preemptions", 0)),
        )


# --- tensor parallel within one pod: the per-rank CPU binding --------------------------------------------------------
# Read by the engine (`engine/affinity.py`) in each rank's process; the operator does not set it (it cannot see the
# cards' topology). One NUMA node per rank, comma-separated, e.g. "0,0,1,1" for four ranks whose cards sit two on
# node 0 and two on node 1. Unset: rank r is bound to the node of index r x nodes / worldSize among the NUMA nodes
# holding the pod's cores. Ranks on one node share its cores among the pod's, split evenly.
RANK_NUMA_NODES_ENV = "NPUSERVE_RANK_NUMA_NODES"
