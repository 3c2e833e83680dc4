"""Loading W8A8 checkpoints into the int8 modules: msModelSlim's and compressed-tensors' tensors land in the fused
Int8Linear / Int8Experts pieces at their rows; the fused pieces' static scales follow each format's rule; what does
not fit is refused by name; a rank's slice under tensor parallel is the whole model's (the row-parallel int32
accumulators of the ranks sum to the whole one, offset correction included); DeepSeek's kv_b_proj is dequantized."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402
from torch import nn  # noqa: E402

from npuserve.catalog.models import get_model_preset  # noqa: E402
from npuserve.engine.backends import int8_reference  # noqa: E402
from npuserve.engine.model.dummy import write_dummy_model  # noqa: E402
from npuserve.engine.model.int8 import Int8Experts, Int8Linear  # noqa: E402
from npuserve.engine.model.loader import WeightLoadError, build_model, init_dummy_weights, load_model  # noqa: E402
from npuserve.engine.model.quant_loader import deq_scale_values  # noqa: E402
from npuserve.engine.model.served_scheme import QuantizationMismatchError, served_spec  # noqa: E402
from npuserve.engine.parallel.layout import TPLayout  # noqa: E402
from npuserve.modelspec import ModelSpec  # noqa: E402
from npuserve.quantization import MSMODELSLIM_DESCRIPTION, QuantizationRequest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from int8_models import write_quantized_checkpoint  # noqa: E402

CPU = torch.device("cpu")
SCHEMES = [QuantizationRequest(format=f, method=m) for f in ("msmodelslim", "compressed-tensors")  # type: ignore[arg-type]
           for m in ("w8a8", "w8a8_dynamic")]
IDS = [f"{r.format}-{r.method}" for r in SCHEMES]


@pytest.fixture(scope="module")
def float_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = get_model_preset("tiny").model_copy(update={"model_type": "qwen2", "attention_bias": True,
                                                       "dtype": "float32"})
    return write_dummy_model(spec, tmp_path_factory.mktemp("dense"), seed=2)


def _quantized(float_folder: Path, tmp_path: Path, request: QuantizationRequest) -> Path:
    return write_quantized_checkpoint(float_folder, tmp_path / "q", request)


def _load(folder: Path) -> nn.Module:
    return load_model(ModelSpec.from_pretrained(folder), folder, torch.float32, CPU)


@pytest.mark.parametrize("request_", SCHEMES, ids=IDS)
def test_tensors_land_in_the_fused_int8_modules(float_dense: Path, tmp_path: Path,
                                                request_: QuantizationRequest) -> None:
    folder = _quantized(float_dense, tmp_path, request_)
    model = _load(folder)
    hf = load_file(str(folder / "model.safetensors"))
    spec = model.spec
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert isinstance(attn.qkv_proj, Int8Linear) and isinstance(mlp.down_proj, Int8Linear)
    assert type(model.lm_head) is nn.Linear  # the head stays float
    q, kv, p = spec.q_size, spec.kv_size, "model.layers.1."
    assert torch.equal(attn.qkv_proj.weight[q : q + kv], hf[p + "self_attn.k_proj.weight"])
    assert torch.equal(attn.qkv_proj.weight_scale[q + kv :], hf[p + "self_attn.v_proj.weight_scale"].reshape(-1))
    assert torch.equal(attn.qkv_proj.bias[:q], hf[p + "self_attn.q_proj.bias"])  # Qwen2's float bias
    assert torch.equal(mlp.gate_up_proj.weight[spec.intermediate_size :], hf[p + "mlp.up_proj.weight"])
    if request_.method == "w8a8":
        assert attn.qkv_proj.input_scale is not None and attn.qkv_proj.quant_bias is not None
        assert torch.equal(attn.qkv_proj.input_scale, hf[p + "self_attn.q_proj.input_scale"])
        if request_.format == "msmodelslim":
            assert torch.equal(attn.qkv_proj.quant_bias[:q], hf[p + "self_attn.q_proj.quant_bias"])
        else:
            assert not attn.qkv_proj.quant_bias.any()


@pytest.mark.parametrize("request_", SCHEMES, ids=IDS)
def test_moe_experts_load_as_int8(tmp_path: Path, request_: QuantizationRequest) -> None:
    spec = get_model_preset("tiny-qwen3-moe").model_copy(update={"dtype": "float32"})
    folder = _quantized(write_dummy_model(spec, tmp_path / "f", seed=2), tmp_path, request_)
    model = _load(folder)
    hf = load_file(str(folder / "model.safetensors"))
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, Int8Experts)
    inter = experts.w2.shape[2]
    p = "model.layers.0.mlp.experts.3."
    assert torch.equal(experts.w13[3, inter:], hf[p + "up_proj.weight"])
    assert torch.equal(experts.w13_scale[3, :inter], hf[p + "gate_proj.weight_scale"].reshape(-1))
    assert torch.equal(experts.w2[3], hf[p + "down_proj.weight"])


def test_deepseek_kv_b_proj_is_dequantized(tmp_path: Path) -> None:
    spec = get_model_preset("tiny-deepseek-v3").model_copy(update={"dtype": "float32"})
    request = QuantizationRequest(format="msmodelslim", method="w8a8")
    folder = _quantized(write_dummy_model(spec, tmp_path / "f", seed=2), tmp_path, request)
    model = _load(folder)
    hf = load_file(str(folder / "model.safetensors"))
    attn = model.model.layers[0].self_attn
    assert type(attn.kv_b_proj) is nn.Linear and isinstance(attn.o_proj, Int8Linear)
    name = "model.layers.0.self_attn.kv_b_proj."
    want = hf[name + "weight"].float() * hf[name + "weight_scale"].float()
    assert torch.equal(attn.kv_b_proj.weight, want)


# --- refusals ------------------------------------------------------------------------------------------------------


def _edit(folder: Path, change: dict[str, torch.Tensor | None]) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    for name, value in change.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(folder / "model.safetensors"))


def test_fused_pieces_of_different_schemes_are_refused(float_dense: Path, tmp_path: Path) -> None:
    folder = _quantized(float_dense, tmp_path, SCHEMES[1])  # msmodelslim W8A8_DYNAMIC
    description = json.loads((folder / MSMODELSLIM_DESCRIPTION).read_text())
    description["model.layers.0.self_attn.k_proj.weight"] = "FLOAT"
    (folder / MSMODELSLIM_DESCRIPTION).write_text(json.dumps(description))
    with pytest.raises(WeightLoadError, match=r"qkv_proj fuses .*k_proj: float.*q_proj: w8a8_dynamic|"
                                              r"qkv_proj fuses .*q_proj: w8a8_dynamic.*k_proj: float"):
        _load(folder)


def test_a_non_zero_weight_offset_is_refused(float_dense: Path, tmp_path: Path) -> None:
    folder = _quantized(float_dense, tmp_path, SCHEMES[1])
    name = "model.layers.0.mlp.down_proj.weight_offset"
    offset = load_file(str(folder / "model.safetensors"))[name]
    offset[3] = 2.0
    _edit(folder, {name: offset})
    with pytest.raises(WeightLoadError, match=r"down_proj\.weight_offset is not zero: asymmetric"):
        _load(folder)


def test_a_wrong_deq_scale_is_refused(float_dense: Path, tmp_path: Path) -> None:
    folder = _quantized(float_dense, tmp_path, SCHEMES[0])
    name = "model.layers.0.self_attn.o_proj.deq_scale"
    _edit(folder, {name: load_file(str(folder / "model.safetensors"))[name] * 1.1})
    with pytest.raises(WeightLoadError, match=r"o_proj\.deq_scale is not input_scale \* weight_scale"):
        _load(folder)


def test_msmodelslim_pieces_must_share_the_input_scale(float_dense: Path, tmp_path: Path) -> None:
    folder = _quantized(float_dense, tmp_path, SCHEMES[0])
    p = "model.layers.0.mlp.up_proj."
    tensors = load_file(str(folder / "model.safetensors"))
    scale = tensors[p + "input_scale"] * 2
    _edit(folder, {p + "input_scale": scale, p + "deq_scale": scale * tensors[p + "weight_scale"].reshape(-1)})
    with pytest.raises(WeightLoadError, match="gate_up_proj fuses pieces with different input scales"):
        _load(folder)


def test_compressed_tensors_pieces_take_the_largest_input_scale(float_dense: Path, tmp_path: Path) -> None:
    folder = _quantized(float_dense, tmp_path, SCHEMES[2])
    p = "model.layers.0.self_attn."
    _edit(folder, {p + "v_proj.input_scale": torch.tensor([0.25]), p + "k_proj.input_scale": torch.tensor([0.125])})
    qkv = _load(folder).model.layers[0].self_attn.qkv_proj
    assert qkv.input_scale.tolist() == [0.25]


def test_a_float_weight_where_int8_is_declared_is_refused(float_dense: Path, tmp_path: Path) -> None:
    folder = _quantized(float_dense, tmp_path, SCHEMES[3])
    _edit(folder, {"model.layers.1.mlp.gate_proj.weight": torch.zeros(256, 64)})
    with pytest.raises(WeightLoadError, match=r"gate_proj\.weight is F32, but the checkpoint's scheme stores"):
        _load(folder)


def test_a_missing_scale_is_refused(float_dense: Path, tmp_path: Path) -> None:
    folder = _quantized(float_dense, tmp_path, SCHEMES[2])
    _edit(folder, {"model.layers.1.self_attn.o_proj.input_scale": None})
    with pytest.raises(WeightLoadError,
                       match=r"missing from the checkpoint: model\.layers\.1\.self_attn\.o_proj\.input_scale"):
        _load(folder)


def test_an_fp16_models_int64_deq_scale_holds_float32_bits() -> None:
    values = torch.tensor([0.0125, 3.5e-4], dtype=torch.float32)
    packed = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # the float32's bits, zero-extended
    assert torch.equal(deq_scale_values(packed), values)


def test_the_engine_config_must_match_the_checkpoint() -> None:
    spec = get_model_preset("tiny").model_copy(update={"quantization": SCHEMES[0].scheme()})
    with pytest.raises(QuantizationMismatchError,
                       match=r"npuserve\.quantization is compressed-tensors W8A8 \(dynamic\), but the checkpoint "
                             r"declares msmodelslim W8A8"):
        served_spec(spec, SCHEMES[3], dummy=False)
    assert served_spec(spec, SCHEMES[0], dummy=False) is spec
    float_spec = get_model_preset("tiny")
    with pytest.raises(QuantizationMismatchError, match="the checkpoint is not quantized"):
        served_spec(float_spec, SCHEMES[0], dummy=False)
    assert served_spec(float_spec, SCHEMES[1], dummy=True).quantization == SCHEMES[1].scheme()


# --- tensor parallel: each rank's slice is the whole model's ------------------------------------------------------


def _dummy(spec: ModelSpec, rank: int, world: int) -> nn.Module:
    model = build_model(spec, torch.float32, CPU, TPLayout.of(spec, rank, world))
    init_dummy_weights(model, seed=5)
    return model


def _int8_linears(model: nn.Module) -> dict[str, Int8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Int8Linear)}


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-moe", "tiny-deepseek-v3"])
@pytest.mark.parametrize("request_", [SCHEMES[0], SCHEMES[3]], ids=[IDS[0], IDS[3]])
def test_two_ranks_hold_the_whole_int8_model(preset: str, request_: QuantizationRequest) -> None:
    spec = get_model_preset(preset).model_copy(update={"quantization": request_.scheme(), "dtype": "float32"})
    whole, ranks = _dummy(spec, 0, 1), [_dummy(spec, r, 2) for r in (0, 1)]
    gen = torch.Generator().manual_seed(0)
    for name, layer in _int8_linears(whole).items():
        parts = [_int8_linears(r)[name] for r in ranks]
        row_parallel = name.endswith(("o_proj", "down_proj"))
        if not row_parallel:  # column-parallel: the ranks' rows, in order (qkv: q, k, v pieces per rank)
            if name.endswith("gate_up_proj"):
                halves = [p.weight.chunk(2) for p in parts]
                stitched = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
                assert torch.equal(stitched, layer.weight), name
            continue
        for part in parts:  # the per-row scales stay whole
            assert torch.equal(part.weight_scale, layer.weight_scale), name
        x_q = torch.randint(-128, 128, (3, layer.in_features), generator=gen, dtype=torch.int8)
        acc = int8_reference.int32_matmul(x_q, layer.weight)
        cols = layer.in_features // 2
        acc_ranks = [int8_reference.int32_matmul(x_q[:, r * cols : (r + 1) * cols].contiguous(), parts[r].weight)
                     for r in (0, 1)]
        if layer.quant_bias is not None:
            acc = acc + layer.quant_bias
            acc_ranks = [a + p.quant_bias for a, p in zip(acc_ranks, parts, strict=True)]
            assert layer.quant_bias.any() and not parts[1].quant_bias.any(), name  # the correction is rank 0's
        assert torch.equal(acc_ranks[0] + acc_ranks[1], acc), name
    for name, module in whole.named_modules():
        if isinstance(module, Int8Experts):
            inter = module.w2.shape[2] // 2
            part = [dict(r.named_modules())[name] for r in ranks]
            assert torch.equal(torch.cat([p.w2 for p in part], dim=2), module.w2)
            gates = torch.cat([p.w13_scale[:, :inter] for p in part], dim=1)
            assert torch.equal(gates, module.w13_scale[:, : 2 * inter])
            assert torch.equal(part[1].w2_scale, module.w2_scale)


def test_the_config_check_names_a_scheme_mismatch(tmp_path: Path) -> None:
    from npuserve.engine.servable import refusals
    from npuserve.mindie_config import minimal_config

    spec = get_model_preset("tiny").model_copy(update={"quantization": SCHEMES[1].scheme()})
    config = minimal_config(tmp_path, extensions={"quantization": {"format": "msmodelslim", "method": "w8a8"}})
    assert [p for p in refusals(config, "cpu", spec) if p.startswith("npuserve.quantization: ")] == [
        "npuserve.quantization: the engine config's npuserve.quantization is msmodelslim W8A8, but the checkpoint "
        "declares msmodelslim W8A8_DYNAMIC; set it to the checkpoint's scheme or leave it out"]


def test_a_bias_folded_into_quant_bias_counts_once(float_dense: Path, tmp_path: Path) -> None:
    """msModelSlim static W8A8 folds the float bias into quant_bias (round(bias / deq_scale)); the float `bias` tensor
    beside it is then not added again: the folded checkpoint computes what the unfolded one does, up to rounding."""
    sys.path.insert(0, str(Path(__file__).parent))
    from int8_models import prompt_logits

    plain = _quantized(float_dense, tmp_path / "plain", SCHEMES[0])
    folded = _quantized(float_dense, tmp_path / "folded", SCHEMES[0])
    tensors = load_file(str(folded / "model.safetensors"))
    for layer in range(2):
        for proj in ("q_proj", "k_proj", "v_proj"):
            p = f"model.layers.{layer}.self_attn.{proj}."
            extra = torch.round(tensors[p + "bias"].float() / tensors[p + "deq_scale"]).to(torch.int32)
            tensors[p + "quant_bias"] = tensors[p + "quant_bias"] + extra
    save_file(tensors, str(folded / "model.safetensors"))
    a, b = _load(plain), _load(folded)
    assert b.model.layers[0].self_attn.qkv_proj.bias.abs().sum() == 0
    assert a.model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0
    tokens = list(range(5, 25))
    want = prompt_logits(a, tokens)
    assert (prompt_logits(b, tokens) - want).abs().max() <= 0.02 * want.abs().max()


def test_per_row_tensors_of_shape_out_load_like_out_by_one(float_dense: Path, tmp_path: Path) -> None:
    folder = _quantized(float_dense, tmp_path, SCHEMES[0])
    tensors = load_file(str(folder / "model.safetensors"))
    want = _load(folder).model.layers[0].self_attn.qkv_proj.weight_scale.clone()
    p = "model.layers.0.self_attn.k_proj."
    _edit(folder, {p + "weight_scale": tensors[p + "weight_scale"].reshape(-1),
                   p + "weight_offset": tensors[p + "weight_offset"].reshape(-1)})
    assert torch.equal(_load(folder).model.layers[0].self_attn.qkv_proj.weight_scale, want)


def test_msmodelslim_static_dequantizes_with_its_deq_scale() -> None:
    """msModelSlim computes deq_scale in float32 before rounding input_scale and weight_scale to bf16 (0.4% apart,
    docs/quantization.md): the loaded layer's input_scale x weight_scale is the checkpoint's deq_scale, as
    vllm-ascend's npu_quant_matmul takes it, not the product of the rounded scales."""
    from tests.quant_checkpoints import quant_checkpoint

    folder = quant_checkpoint("msmodelslim", "dense", "w8a8")
    model = load_model(ModelSpec.from_pretrained(folder), folder, torch.float32, CPU)
    layer = model.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert isinstance(layer, Int8Linear) and layer.input_scale is not None
    tensors: dict[str, torch.Tensor] = {}
    for path in folder.glob("*.safetensors"):
        tensors |= load_file(path)
    want = torch.cat([deq_scale_values(tensors[f"model.layers.0.self_attn.{p}.deq_scale"])
                      for p in ("q_proj", "k_proj", "v_proj")])
    rounded = torch.cat([tensors[f"model.layers.0.self_attn.{p}.weight_scale"].float().reshape(-1)
                         for p in ("q_proj", "k_proj", "v_proj")]) * layer.input_scale
    assert not torch.allclose(rounded, want, rtol=1e-4, atol=0.0)  # the two differ in this checkpoint
    torch.testing.assert_close(layer.input_scale * layer.weight_scale, want, rtol=1e-6, atol=0.0)
