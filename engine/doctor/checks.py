"""`npuserve doctor`'s checks, in order: the driver (`npu-smi`), torch, torch_npu, CANN, the op-plugin release line,
NNAL (ATB), the visible cards, each op the backend will call (present, with the keywords it passes), the numeric smoke
tests on the card (smoke.py), HCCL across the cards when worldSize > 1, and the memory the KV pool would get. A check
that needs what an earlier one found missing is skipped, saying which.

What a check cannot reach from here is injected (`Probes`): the backend on the card and the HCCL run, so the tests run
every check against the fake torch_npu.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from npuserve.engine.backends.base import BackendUnavailableError
from npuserve.engine.backends.npu import NPUBackend, refuse_unusable
from npuserve.engine.backends.npu_stack import (
    FIRST_LINE,
    INT8_LINEAR_OPS,
    MLA_OPS,
    NPUStack,
    detect,
    matrix_lines,
    signature_problem,
)
from npuserve.engine.doctor.report import DoctorCheck, DoctorReport, Status
from npuserve.engine.doctor.smoke import smoke_checks
from npuserve.engine_contract import NPU_MEMORY_FRACTION_ENV
from npuserve.modelspec import ModelSpec
from npuserve.npu_contract import NPU_BLOCK_SIZE, block_size_problem

GiB = 1024**3
DEFAULT_MEMORY_FRACTION = 0.8
NPU_SMI_TIMEOUT_S = 30
HCCL_TIMEOUT_S = 300


@dataclass(frozen=True)
class DoctorOptions:
    world_size: int = 1
    block_size: int = NPU_BLOCK_SIZE
    model: Path | None = None  # an HF model folder: the memory check then counts KV blocks of its shape


def _backend_on_card_0() -> NPUBackend:
    return NPUBackend(None, 0)


def hccl_all_reduce(world_size: int) -> str:
    """One process per card joins an HCCL world over loopback and all-reduces a one: each must read `world_size`.
    Returns what they printed; raises on a failure or a wrong sum."""
    script = (
        "import os, sys, torch, torch_npu, torch.distributed as dist\n"
        "rank, n = int(sys.argv[1]), int(sys.argv[2])\n"
        "torch.npu.set_device(rank)\n"
        "dist.init_process_group('hccl', init_method='tcp://127.0.0.1:' + sys.argv[3], rank=rank, world_size=n)\n"
        "t = torch.ones(1, device=f'npu:{rank}')\n"
        "dist.all_reduce(t)\n"
        "print(int(t.item()))\n"
        "dist.destroy_process_group()\n"
    )
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, "-P", "-c", script, str(r), str(world_size), port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world_size)]
    outputs = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=HCCL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise TimeoutError(f"rank {rank} did not finish the all-reduce in {HCCL_TIMEOUT_S} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"rank {rank} exited with {proc.returncode}: {err.strip().splitlines()[-1:]}")
        outputs.append(out.strip())
    if any(o != str(world_size) for o in outputs):
        raise RuntimeError(f"the all-reduce of ones over {world_size} ranks read {outputs}")
    return f"{world_size} ranks all-reduced over HCCL"


@dataclass
class Probes:
    """What the checks reach through: the backend on the card, and the HCCL run (both replaceable in tests)."""

    make_backend: Callable[[], NPUBackend] = _backend_on_card_0
    hccl: Callable[[int], str] = hccl_all_reduce
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))


def _check(name: str, status: Status, detail: str) -> DoctorCheck:
    return DoctorCheck(name=name, status=status, detail=detail)


def check_npu_smi(environ: dict[str, str]) -> DoctorCheck:
    path = shutil.which("npu-smi", path=environ.get("PATH"))
    if path is None:
        return _check("driver (npu-smi)", "skip", "npu-smi is not on PATH (the driver's tool: on a host it comes "
                      "with the driver; in a container the Ascend docker runtime mounts it)")
    try:
        result = subprocess.run([path, "info"], capture_output=True, text=True, timeout=NPU_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return _check("driver (npu-smi)", "fail", f"npu-smi info: {e}")
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:]
        return _check("driver (npu-smi)", "fail", f"npu-smi info exited with {result.returncode}: {tail}")
    version = re.search(r"Version:\s*([\w.\-]+)", result.stdout)
    return _check("driver (npu-smi)", "ok", f"npu-smi info answers (driver {version.group(1) if version else '?'})")


def check_cann(ops: Any, stack: NPUStack, environ: dict[str, str]) -> DoctorCheck:
    """CANN's version as torch_npu reads it (torch_npu.npu.utils.get_cann_version, 7.0.0 on), else ASCEND_HOME_PATH's
    `ascend_*_install.info` (torch_npu's collect_env does the same)."""
    version = ""
    reader = getattr(getattr(getattr(ops, "npu", None), "utils", None), "get_cann_version", None)
    if callable(reader):
        try:
            version = str(reader("CANN"))
        except Exception:  # an old driver makes it raise; the file is the fallback
            version = ""
    if not version and environ.get("ASCEND_HOME_PATH"):
        for info in sorted(Path(environ["ASCEND_HOME_PATH"]).glob("*/ascend_*_install.info")):
            found = re.search(r"^version=(\S+)", info.read_text(errors="replace"), re.MULTILINE)
            if found:
                version = found.group(1)
                break
    if not version:
        return _check("CANN", "warn", "version not found (torch_npu does not say, ASCEND_HOME_PATH holds no "
                      "ascend_*_install.info)")
    expected = stack.release.cann if stack.release else None
    if expected and not version.startswith(expected):
        return _check("CANN", "warn", f"{version}; op-plugin {stack.release.name if stack.release else ''} pairs "
                      f"with CANN {expected}")
    return _check("CANN", "ok", version)


def check_release(stack: NPUStack) -> DoctorCheck:
    problems = [p for p in (stack.torch_mismatch(),) if p]
    if stack.release is None:
        return _check("op-plugin", "warn", f"torch_npu {stack.torch_npu_version} is outside the tested matrix ("
                      + "; ".join(matrix_lines()) + ")" + (f"; {problems[0]}" if problems else ""))
    if problems:
        return _check("op-plugin", "fail", problems[0])
    return _check("op-plugin", "ok", f"{stack.release.name} (torch_npu {stack.torch_npu_version} with torch "
                  f"{stack.torch_version}; pairs with CANN and NNAL {stack.release.cann})")


def check_ops(ops: Any, stack: NPUStack) -> list[DoctorCheck]:
    """Each op the backend calls: present, with the keywords it passes. A MoE, MLA or int8 op that is absent is a
    warning, not a failure: only a model with MoE layers, latent attention or W8A8 weights needs it (the backend
    refuses such a model on this stack, naming the op)."""
    checks = []
    optional = ({op: "MoE" for op in stack.moe_ops() if op != "npu_swiglu"} | {op: "MLA" for op in MLA_OPS}
                | {op: "W8A8" for op in INT8_LINEAR_OPS})
    for name in (*stack.used_ops(), *optional):
        op = getattr(ops, name, None)
        if not callable(op):
            if name in optional:
                checks.append(_check(f"op {name}", "warn", f"absent from {stack.describe()}: a {optional[name]} "
                                     f"model is refused on this stack (op-plugin {FIRST_LINE[name]} has it)"))
                continue
            checks.append(_check(f"op {name}", "fail", f"absent from {stack.describe()}"))
            continue
        problem = signature_problem(name, op)
        if problem:
            checks.append(_check(f"op {name}", "fail", f"present, but {problem}"))
        else:
            checks.append(_check(f"op {name}", "ok", "present, takes the backend's keywords"))
    return checks


def check_memory(backend: NPUBackend, options: DoctorOptions, environ: dict[str, str]) -> DoctorCheck:
    info = backend.memory_info()  # after emptying the allocator's cache
    fraction = float(environ.get(NPU_MEMORY_FRACTION_ENV, DEFAULT_MEMORY_FRACTION))
    budget = int(info.free_bytes * fraction)
    detail = (f"{info.free_bytes / GiB:.1f} of {info.total_bytes / GiB:.1f} GiB free on card {backend.device_index}; "
              f"the KV pool would get up to {budget / GiB:.1f} GiB ({NPU_MEMORY_FRACTION_ENV} {fraction:g}), less the "
              "weights and a warm-up's activations")
    if options.model is not None:
        spec = ModelSpec.from_pretrained(options.model)
        problem = block_size_problem("npu", options.block_size, spec.head_dim, latent_attention=spec.mla is not None)
        if problem:
            return _check("memory", "fail", problem)
        dtype = spec.dtype if spec.dtype in ("float16", "bfloat16") else "bfloat16"
        per_block = spec.kv_bytes_per_block(options.block_size, world_size=options.world_size, dtype=dtype)
        weights = spec.num_parameters * 2 // options.world_size
        blocks = max(0, budget - weights) // per_block
        detail += (f"; {options.model.name}: {weights / GiB:.1f} GiB of {dtype} weights per card leave "
                   f"{blocks} blocks of {options.block_size} tokens ({per_block} bytes each) before the warm-up")
        if blocks < 1:
            return _check("memory", "fail", detail)
    return _check("memory", "ok", detail)


def diagnose(options: DoctorOptions, probes: Probes | None = None) -> DoctorReport:
    probes = probes or Probes()
    checks = [check_npu_smi(probes.environ), _check("torch", "ok", torch.__version__)]

    def finish(npu_present: bool) -> DoctorReport:
        return DoctorReport.of(checks, npu_present)

    try:
        ops = importlib.import_module("torch_npu")
    except (ImportError, OSError) as e:
        reason = ("torch_npu is not installed, so no Ascend card can be driven from here" if isinstance(e, ImportError)
                  else f"torch_npu is installed but CANN's libraries do not load ({e})")
        checks.append(_check("torch_npu", "fail", reason))
        return finish(False)
    stack = detect(ops, torch.__version__)
    checks.append(_check("torch_npu", "ok", stack.describe()))
    checks.append(check_cann(ops, stack, probes.environ))
    checks.append(check_release(stack))
    count = int(torch.npu.device_count())  # type: ignore[attr-defined]
    visible = probes.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    seen = f"torch.npu.device_count() = {count}" + (f" (ASCEND_RT_VISIBLE_DEVICES={visible})" if visible else "")
    if count < 1:
        checks.append(_check("devices", "fail", f"{seen}: no card is visible"))
        return finish(False)
    if count < options.world_size:
        checks.append(_check("devices", "fail", f"{seen}: worldSize {options.world_size} needs {options.world_size}"))
    else:
        checks.append(_check("devices", "ok", seen))
    try:
        refuse_unusable(stack)
        backend = probes.make_backend()  # makes the first ATB call: NNAL loads or fails here
        checks.append(_check("NNAL (ATB)", "ok", "libatb.so loads (ATB_HOME_PATH="
                             f"{probes.environ.get('ATB_HOME_PATH', 'unset')})"))
    except BackendUnavailableError as e:
        name = "NNAL (ATB)" if isinstance(e.__cause__, OSError) else "backend"
        checks.append(_check(name, "fail", str(e)))
        checks.extend(check_ops(ops, stack))
        checks.append(_check("smoke tests", "skip", f"need the backend on the card ({name} failed)"))
        return finish(True)
    checks.extend(check_ops(ops, stack))
    checks.extend(smoke_checks(backend))
    if options.world_size > 1:
        try:
            checks.append(_check("hccl", "ok", probes.hccl(options.world_size)))
        except Exception as e:  # the collective's failure is the finding
            checks.append(_check("hccl", "fail", f"{type(e).__name__}: {e}"))
    else:
        checks.append(_check("hccl", "skip", "worldSize 1: no collective to check (--world-size N checks N cards)"))
    checks.append(check_memory(backend, options, probes.environ))
    return finish(True)


def preflight(backend: NPUBackend, spec: ModelSpec | None = None) -> None:
    """The engine's start-up run of the op checks and the smoke tests on its card (the stack and NNAL were checked
    when the backend was built): BackendUnavailableError naming each failed check. With the model's `spec`, the MoE
    and MLA smoke tests count only for a model that has MoE layers / latent attention: a dense model does not wait
    on ops it never calls."""
    unused = set()
    if spec is not None and spec.moe is None:
        unused.add("smoke: moe")
    if spec is not None and spec.mla is None:
        unused.add("smoke: mla")
    failed = [c for c in (*check_ops(backend._ops, backend.stack), *smoke_checks(backend))
              if c.status == "fail" and c.name not in unused]
    if failed:
        raise BackendUnavailableError(
            f"npuserve doctor's checks failed on card {backend.device_index} ({backend.stack.describe()}): "
            + "; ".join(f"{c.name}: {c.detail}" for c in failed))
