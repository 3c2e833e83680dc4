"""What the engine refuses at start-up: MindIE settings it would otherwise accept and not act on.

A MindIE `config.json` loads as it is (npuserve/mindie_config.py), but a setting that changes what MindIE does and
that this engine does not do is refused here, each with a message naming it, rather than silently ignored. The
device and worldSize limits are the contract's (`engine_contract.unservable`), the same words the operator puts in
the InferenceService's status; the KV block size a device's kernels take is `npu_contract.block_size_problem`'s, the
rule the operator's plan applies.
"""

from __future__ import annotations

from npuserve.engine.model.served_scheme import QuantizationMismatchError, served_spec
from npuserve.engine.parallel.layout import TensorParallelLayoutError, TPLayout
from npuserve.engine_contract import FLAG_MASTER_ADDR, FLAG_NNODES, FLAG_NODE_RANK, unservable
from npuserve.mindie_config import MindIEConfig
from npuserve.modelspec import ModelSpec
from npuserve.npu_contract import block_size_problem


class UnservableConfigError(ValueError):
    """The configuration asks for something this engine does not do; the message names each setting."""


def multi_node_problem(config: MindIEConfig, nnodes: int) -> str | None:
    """`BackendConfig.multiNodesInferEnabled` must say what `--nnodes` does: true exactly when the replica's ranks
    span pods (the operator renders it so for a LeaderWorkerSet group)."""
    enabled = config.BackendConfig.multiNodesInferEnabled
    if nnodes > 1 and not enabled:
        return (f"BackendConfig.multiNodesInferEnabled is false, but {FLAG_NNODES} {nnodes} spreads the replica's "
                "ranks over that many pods: set it true (the operator renders it true for such a replica)")
    if nnodes == 1 and enabled:
        return (f"BackendConfig.multiNodesInferEnabled is true, but this engine runs all its ranks in one pod "
                f"({FLAG_NNODES} 1): pass {FLAG_NNODES}, {FLAG_NODE_RANK} and {FLAG_MASTER_ADDR} to spread them over "
                "pods, or set it false")
    return None


def refusals(config: MindIEConfig, device: str, spec: ModelSpec | None = None, nnodes: int = 1) -> list[str]:
    """Every setting of `config` the engine would not honour, as `path: why`; `device` is the resolved backend,
    `spec` the model's architecture (whether it splits over worldSize ranks), `nnodes` the pods the ranks span."""
    backend, model = config.BackendConfig, config.model
    out: list[str] = []
    layout = unservable(device, model.worldSize)
    if layout is not None:
        out.append(f"BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize / npuserve.device: {layout}")
    if spec is not None and model.worldSize > 1:
        try:
            TPLayout.of(spec, 0, model.worldSize)
        except TensorParallelLayoutError as e:
            out.append(f"BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize: {e}")
    ext = config.npuserve
    if spec is not None and ext is not None and ext.quantization is not None:
        try:
            served_spec(spec, ext.quantization, ext.loadFormat == "dummy")
        except QuantizationMismatchError as e:
            out.append(f"npuserve.quantization: {e}")
    if spec is not None:
        problem = block_size_problem(device, config.schedule.cacheBlockSize, spec.head_dim,
                                     latent_attention=spec.mla is not None)
        if problem is not None:
            out.append(f"BackendConfig.ScheduleConfig.cacheBlockSize: {problem}")
    cards = backend.npuDeviceIds[0] if backend.npuDeviceIds else []
    per_pod = model.worldSize // max(1, nnodes)
    if device != "cpu" and len(cards) < per_pod:
        pods = f" ({per_pod} per pod over {FLAG_NNODES} {nnodes})" if nnodes > 1 else ""
        out.append(f"BackendConfig.npuDeviceIds: [{', '.join(map(str, cards))}] lists {len(cards)} card(s) for "
                   f"worldSize {model.worldSize}{pods}; list one logical card id per rank of the pod")
    multi = multi_node_problem(config, nnodes)
    if multi is not None:
        out.append(multi)
    if backend.modelInstanceNumber != 1:
        out.append(f"BackendConfig.modelInstanceNumber is {backend.modelInstanceNumber}: one engine serves one "
                   "model instance; run more replicas instead")
    if len(backend.ModelDeployConfig.ModelConfig) != 1:
        out.append("BackendConfig.ModelDeployConfig.ModelConfig: one engine serves exactly one model")
    if model.trustRemoteCode:
        out.append("ModelConfig[0].trustRemoteCode: the engine runs only its built-in architectures and never "
                   "runs a model's own code; set it false")
    if config.ServerConfig.get("httpsEnabled"):
        out.append("ServerConfig.httpsEnabled: the engine serves plain HTTP; terminate TLS in front of it "
                   "(Service mesh, ingress) and set it false")
    return out


def check_servable(config: MindIEConfig, device: str, spec: ModelSpec | None = None, nnodes: int = 1) -> None:
    problems = refusals(config, device, spec, nnodes)
    if problems:
        raise UnservableConfigError("the engine cannot serve this configuration:\n  " + "\n  ".join(problems))
