"""`npuserve doctor` against the FAKE torch_npu (tests/fake_torch_npu.py) and on this machine (no NPU): each check
runs, each failure is reported under its check's name, the verdict and exit code follow; the engine runs the op
checks and smoke tests at start-up on npu."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from npuserve.catalog.models import get_model_preset
from npuserve.engine import rank_runner
from npuserve.engine.backends.base import BackendUnavailableError
from npuserve.engine.backends.npu import NPUBackend
from npuserve.engine.backends.npu_stack import SPLITFUSE_OP
from npuserve.engine.doctor import DoctorOptions, DoctorReport, Probes, diagnose, preflight
from npuserve.mindie_config import minimal_config
from npuserve.modelspec import ModelSpec
from tests.fake_npu_attention import _npu_paged_attention
from tests.fake_torch_npu import RELEASES, FakeTorchNPU, install_fake_torch_npu

OPS = ["npu_scatter_pa_kv_cache", "_npu_reshape_and_cache"]  # one of the two, per release
SMOKES = ["smoke: cache write", "smoke: prefill", "smoke: prefix prefill", "smoke: decode", "smoke: chunked prefill",
          "smoke: rms_norm", "smoke: rope", "smoke: swiglu", "smoke: moe", "smoke: mla"]


def _install(monkeypatch: pytest.MonkeyPatch, release: str = "7.3.0", **kwargs: Any) -> FakeTorchNPU:
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, release=release, **kwargs)
    # the torch this torch_npu needs (the test's own torch is newer)
    monkeypatch.setattr(torch, "__version__", fake.release.torch_npu.split(".post")[0])
    return fake


def _probes(fake: FakeTorchNPU, hccl: Any = None, **environ: str) -> Probes:
    probes = Probes(make_backend=lambda: NPUBackend(device=fake.device), environ={"PATH": "", **environ})
    if hccl is not None:
        probes.hccl = hccl
    return probes


def _status(report: DoctorReport) -> dict[str, str]:
    return {c.name: c.status for c in report.checks}


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_a_healthy_stack_passes_every_check(monkeypatch: pytest.MonkeyPatch, release: str) -> None:
    fake = _install(monkeypatch, release)
    report = diagnose(DoctorOptions(), _probes(fake))
    status = _status(report)
    assert report.ok and report.npu_present, report.lines()
    assert status["driver (npu-smi)"] == "skip" and status["hccl"] == "skip"
    for name in ("torch", "torch_npu", "CANN", "op-plugin", "devices", "NNAL (ATB)", "memory", *SMOKES):
        assert status[name] == "ok", (name, report.lines())
    writer = "npu_scatter_pa_kv_cache" if release.startswith("26.") else "_npu_reshape_and_cache"
    assert status[f"op {writer}"] == "ok" and not {f"op {op}" for op in OPS if op != writer} & set(status)
    assert report.verdict.startswith("ready")
    assert report.lines()[-1] == f"verdict: {report.verdict}" and len(report.lines()) == len(report.checks) + 1


def test_missing_nnal_fails_its_check_and_skips_the_smoke_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install(monkeypatch, nnal=False)
    report = diagnose(DoctorOptions(), _probes(fake))
    status = _status(report)
    assert status["NNAL (ATB)"] == "fail" and status["smoke tests"] == "skip"
    assert "not ready" in report.verdict and "NNAL (ATB)" in report.verdict and not report.ok


def test_a_missing_op_fails_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install(monkeypatch)
    delattr(fake.module, "_npu_paged_attention_splitfuse")
    report = diagnose(DoctorOptions(), _probes(fake))
    status = _status(report)
    assert status["backend"] == "fail" and status["op _npu_paged_attention_splitfuse"] == "fail"
    assert "op _npu_paged_attention_splitfuse" in report.verdict


@pytest.mark.parametrize(("op", "smoke"), [("npu_moe_init_routing_v2", "smoke: moe"),
                                           ("npu_fused_infer_attention_score", "smoke: mla")])
def test_a_missing_moe_or_mla_op_warns_and_skips_its_smoke_test_only(monkeypatch: pytest.MonkeyPatch, op: str,
                                                                     smoke: str) -> None:
    fake = _install(monkeypatch)
    delattr(fake.module, op)  # a torch_npu outside the matrix: a dense model still runs, a MoE/MLA one is refused
    report = diagnose(DoctorOptions(), _probes(fake))
    status = _status(report)
    assert report.ok, report.lines()
    assert status[f"op {op}"] == "warn" and status[smoke] == "skip"
    assert "refused on this stack" in next(c.detail for c in report.checks if c.name == f"op {op}")


def test_on_7_0_0_the_moe_smoke_test_runs_finalize_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install(monkeypatch, "7.0.0")
    report = diagnose(DoctorOptions(), _probes(fake))
    status = _status(report)
    assert status["smoke: moe"] == "ok" and status["op npu_moe_finalize_routing"] == "ok"
    assert "op npu_moe_token_unpermute" not in status
    assert "npu_moe_finalize_routing" in next(c.detail for c in report.checks if c.name == "smoke: moe")


def test_an_op_without_the_backends_keyword_fails_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install(monkeypatch)
    wrapped = fake.module._npu_paged_attention
    names = [a for a in wrapped.default._schema.arguments if a.name != "context_lens"]
    wrapped.default._schema.arguments = names  # an op of the same name that takes no context_lens
    report = diagnose(DoctorOptions(), _probes(fake))
    check = next(c for c in report.checks if c.name == "op _npu_paged_attention")
    assert check.status == "fail" and "lacks context_lens" in check.detail


@pytest.mark.parametrize(("op", "smokes"), [("_npu_paged_attention", ["smoke: decode"]),
                                            ("_npu_flash_attention_qlens", ["smoke: prefix prefill"]),
                                            ("_npu_paged_attention_splitfuse", ["smoke: chunked prefill"]),
                                            ("_npu_flash_attention", ["smoke: prefill"]),
                                            ("_npu_reshape_and_cache", ["smoke: cache write"]),
                                            ("npu_rms_norm", ["smoke: rms_norm"]),
                                            ("npu_rotary_mul", ["smoke: rope"]),
                                            ("npu_swiglu", ["smoke: swiglu", "smoke: moe"]),  # the MoE chain's too
                                            ("npu_grouped_matmul", ["smoke: moe"]),
                                            ("npu_moe_token_unpermute", ["smoke: moe"]),
                                            ("npu_moe_gating_top_k", ["smoke: moe"]),
                                            ("npu_kv_rmsnorm_rope_cache", ["smoke: mla"]),
                                            ("npu_fused_infer_attention_score", ["smoke: mla"])])
def test_an_op_that_computes_wrong_numbers_fails_its_smoke_test(monkeypatch: pytest.MonkeyPatch, op: str,
                                                                smokes: list[str]) -> None:
    fake = _install(monkeypatch)
    right = getattr(fake.module, op)

    def wrong(*args: Any, **kwargs: Any) -> Any:
        result = right(*args, **kwargs)
        for tensor in (kwargs.get("out"), kwargs.get("key_cache"), result):  # spoil what the op produced
            if isinstance(tensor, torch.Tensor):
                tensor.add_(0.5)
            elif isinstance(tensor, tuple | list):
                for t in tensor:
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        t.add_(0.5)
        return result

    wrong.default = right.default  # type: ignore[attr-defined]
    monkeypatch.setattr(fake.module, op, wrong)
    report = diagnose(DoctorOptions(), _probes(fake))
    failed = [c.name for c in report.failed()]
    assert failed == smokes, report.lines()


def test_a_smoke_test_fails_when_its_step_goes_to_another_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install(monkeypatch)
    monkeypatch.setattr(NPUBackend, "kernel", lambda self, meta, cache: SPLITFUSE_OP)  # right numbers, wrong kernel
    report = diagnose(DoctorOptions(), _probes(fake))
    failed = {c.name: c.detail for c in report.failed()}
    assert set(failed) == {"smoke: prefill", "smoke: prefix prefill", "smoke: decode"}, report.lines()
    assert all("went to _npu_paged_attention_splitfuse" in detail for detail in failed.values())


def test_no_visible_card_means_no_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install(monkeypatch, physical_cards=0)
    report = diagnose(DoctorOptions(), _probes(fake))
    assert _status(report)["devices"] == "fail" and not report.npu_present
    assert report.verdict.startswith("no NPU is present on this machine")


def test_hccl_runs_across_the_cards_when_world_size_is_above_one(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install(monkeypatch)
    seen: list[int] = []

    def hccl(world_size: int) -> str:
        seen.append(world_size)
        return f"{world_size} ranks all-reduced over HCCL"

    assert _status(diagnose(DoctorOptions(world_size=4), _probes(fake, hccl)))["hccl"] == "ok" and seen == [4]

    def broken(world_size: int) -> str:
        raise TimeoutError("rank 1 did not finish the all-reduce in 300 s")

    report = diagnose(DoctorOptions(world_size=2), _probes(fake, broken))
    assert _status(report)["hccl"] == "fail" and "hccl" in report.verdict
    report = diagnose(DoctorOptions(world_size=16), _probes(fake, hccl))  # 8 cards
    assert _status(report)["devices"] == "fail"


def test_cann_and_torch_that_do_not_pair_with_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _install(monkeypatch)
    fake.npu.cann = "8.2.RC1"
    status = _status(diagnose(DoctorOptions(), _probes(fake)))
    assert status["CANN"] == "warn" and status["op-plugin"] == "ok"
    monkeypatch.setattr(torch, "__version__", "2.6.0")
    status = _status(diagnose(DoctorOptions(), _probes(fake)))
    assert status["op-plugin"] == "fail"


def test_the_memory_check_counts_the_models_kv_blocks(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    fake = _install(monkeypatch, free_bytes=10 * 1024**3, cached_bytes=2 * 1024**3)
    report = diagnose(DoctorOptions(model=tiny_model_dir), _probes(fake, NPU_MEMORY_FRACTION="0.5"))
    memory = next(c for c in report.checks if c.name == "memory")
    assert memory.status == "ok" and "12.0 of 64.0 GiB free" in memory.detail and "up to 6.0 GiB" in memory.detail
    assert "blocks of 128 tokens" in memory.detail
    report = diagnose(DoctorOptions(model=tiny_model_dir, block_size=8), _probes(fake))
    memory = next(c for c in report.checks if c.name == "memory")
    assert memory.status == "fail" and "cacheBlockSize 8 on npu" in memory.detail


def test_on_this_machine_it_says_no_npu_is_present() -> None:
    code = "import sys; from npuserve.cli import main; sys.exit(main(sys.argv[1:]))"
    plain = subprocess.run([sys.executable, "-P", "-c", code, "doctor"], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 1, plain.stderr
    assert "[FAIL] torch_npu" in plain.stdout
    assert "verdict: no NPU is present on this machine: torch_npu is not installed" in plain.stdout
    as_json = subprocess.run([sys.executable, "-P", "-c", code, "doctor", "--json"], capture_output=True, text=True,
                             timeout=300)
    report = DoctorReport.model_validate(json.loads(as_json.stdout))
    assert as_json.returncode == 1 and not report.npu_present and not report.ok


def test_the_engine_runs_the_checks_at_start_up_on_npu(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    fake = _install(monkeypatch)

    def wrong_decode(**kwargs: Any) -> None:
        _npu_paged_attention(**{k: v for k, v in kwargs.items() if k != "workspace"})
        kwargs["out"].zero_()

    wrong_decode.default = fake.module._npu_paged_attention.default  # type: ignore[attr-defined]
    monkeypatch.setattr(fake.module, "_npu_paged_attention", wrong_decode)
    monkeypatch.setattr(rank_runner, "get_backend", lambda *args: NPUBackend(device=fake.device))
    config = minimal_config(tiny_model_dir, max_seq_len=256)
    with pytest.raises(BackendUnavailableError, match=r"npuserve doctor's checks failed on card 0 .*smoke: decode"):
        rank_runner.build_rank_runner(config, tiny_model_dir, seed=0)


def test_the_start_up_checks_count_the_moe_and_mla_smoke_tests_only_for_models_that_need_them(
        monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    fake = _install(monkeypatch)
    right = fake.module.npu_fused_infer_attention_score

    def wrong(*args: Any, **kwargs: Any) -> Any:
        out, lse = right(*args, **kwargs)
        return out + 0.5, lse

    wrong.default = right.default  # type: ignore[attr-defined]
    monkeypatch.setattr(fake.module, "npu_fused_infer_attention_score", wrong)
    backend = NPUBackend(device=fake.device)
    dense = ModelSpec.from_pretrained(tiny_model_dir)
    preflight(backend, dense)  # a dense model never calls FIA's MLA decode
    deepseek = get_model_preset("tiny-deepseek-v3")
    with pytest.raises(BackendUnavailableError, match="smoke: mla"):
        preflight(backend, deepseek)
