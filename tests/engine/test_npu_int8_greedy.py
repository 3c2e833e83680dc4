"""Whole W8A8 dummy models (the tiny dense model and `tiny-qwen3-moe`, quantized by the real msModelSlim and
llm-compressor: tests/quant_checkpoints.py) through the model runner with the npu backend against the FAKE
torch_npu (tests/fake_torch_npu.py, tests/fake_npu_quant.py): the int8 layers run `npu_quantize` /
`npu_dynamic_quant` + `npu_quant_matmul`, the int8 experts the grouped matmul's int8 form, and the logits of the
greedy run's two prefills (three prompts together, then one behind a two-block prefix-cache hit) stay within a
bound of the CPU backend's (the torch reference of the same int8 math).

Why logits and not tokens, as the float greedy tests compare: the float fakes compute what the CPU backend computes,
bit for bit, but the int8 path rounds in other places (test_npu_int8_fake.py's docstring: the fp16 deq_scale's 19
bits, 1/input_scale, the product rounded before the float bias, the experts' 16-bit intermediates), a layer's
output moves by about 3e-4 of its largest value, and the random dummy's logits are so flat (top-2 margins down to
2e-3 of the largest logit) that such moves flip argmaxes. Measured here on the tools' checkpoints (2026-11-27,
float16, both releases alike; largest |npu - cpu| over the largest |cpu logit|, the worse of the two prefills):
tiny msModelSlim W8A8 1.6e-2, W8A8_DYNAMIC 9.9e-3, llm-compressor W8A8 2.2e-2; tiny-qwen3-moe msModelSlim
W8A8_DYNAMIC 9.2e-3 (the engine's own quantization, before: 2.0e-2, 8.8e-3, 2.2e-2, 9.1e-3). The bound, 5e-2,
is over twice the largest. Where the CPU's top-2 margin is over twice the bound, the argmax must be the same.
"""

from __future__ import annotations

import pytest
import torch

from npuserve.engine.backends.cpu import CPUBackend
from npuserve.engine.backends.npu import NPUBackend
from npuserve.engine.runner import ModelRunner
from npuserve.modelspec import ModelSpec
from tests.fake_torch_npu import install_fake_torch_npu
from tests.npu_testing import runner_of
from tests.paged_inputs import greedy_tokens
from tests.quant_checkpoints import quant_checkpoint

DTYPE = torch.float16
BOUND = 5e-2  # of the largest |logit|
# (model, tool, method) of quant_checkpoint: dense is the tiny preset, moe tiny-qwen3-moe
CASES = [("dense", "msmodelslim", "w8a8"), ("dense", "msmodelslim", "w8a8_dynamic"),
         ("dense", "llmcompressor", "w8a8"), ("moe", "msmodelslim", "w8a8_dynamic")]


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(29)
    # the second prompt spans two whole blocks and more: the last prompt is admitted behind them (a prefix hit)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in (20, 300, 45, 60)]


def _prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The logits of the greedy run's two prefills (the decodes after them follow sampled tokens, which may part)."""
    seen: list[torch.Tensor] = []
    compute = runner.model.compute_logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = compute(hidden)
        seen.append(out.float().clone())
        return out

    runner.model.compute_logits = recorded  # type: ignore[method-assign]
    greedy_tokens(runner, prompts, steps=1, seed=30)
    return seen[:2]


@pytest.mark.parametrize("release", ["7.0.0", "26.0.0"])
@pytest.mark.parametrize(("model", "tool", "method"), CASES, ids=["-".join(c) for c in CASES])
def test_int8_model_logits_on_the_fake_npu_are_the_cpu_backends(monkeypatch: pytest.MonkeyPatch, model: str,
                                                                tool: str, method: str, release: str) -> None:
    model_dir = quant_checkpoint(tool, model, method)  # type: ignore[arg-type]
    spec = ModelSpec.from_pretrained(model_dir)
    assert spec.quantization is not None and spec.quantization.method == method
    prompts = _prompts(spec.vocab_size)
    expected = _prefill_logits(runner_of(model_dir, CPUBackend(), DTYPE), prompts)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, release=release)
    actual = _prefill_logits(runner_of(model_dir, NPUBackend(device=fake.device), DTYPE), prompts)
    assert [a.shape for a in actual] == [e.shape for e in expected] == [(3, spec.vocab_size), (1, spec.vocab_size)]
    for a, e in zip(actual, expected, strict=True):
        scale = float(e.abs().max())
        assert float((a - e).abs().max()) <= BOUND * scale
        top = e.topk(2, dim=-1).values
        clear = (top[:, 0] - top[:, 1]) > 2 * BOUND * scale
        assert torch.equal(a.argmax(-1)[clear], e.argmax(-1)[clear])
    calls = fake.calls
    assert calls["npu_quant_matmul"] > 0
    assert (calls["npu_quantize"] > 0) == (method == "w8a8")
    assert (calls["npu_trans_quant_param"] > 0) == (method == "w8a8")  # float16: the int64 deq_scale
    if model == "moe":
        assert calls["npu_grouped_matmul"] == 2 * calls["npu_moe_init_routing_v2"] > 0
