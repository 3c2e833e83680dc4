"""npuserve's reading of W8A8 checkpoints against what the real tools write (issue 31): msModelSlim and
llm-compressor, run on the CPU on the dummy models (`tests/quant_checkpoints.py`). Every expectation comes from the
tool's output: which tensors it stored as int8, what its declaration says, the bytes in its safetensors files.

Cold: the two tools' virtualenvs (torch each) and a quantization run per checkpoint (see docs/quantization.md for
the measured times); cached afterwards, the module runs in seconds.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from npuserve.modelspec import ModelSpec, UnsupportedModelError
from tests.quant_checkpoints import mindie_checkpoint, quant_checkpoint, refused_checkpoint

pytestmark = pytest.mark.slow

# the bytes per element of the safetensors dtypes the tools write
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}

# dense (Llama) and MoE (Qwen3-MoE) in both methods; DeepSeek-V3 (MoE and latent attention) static
CHECKPOINTS = [(tool, model, scheme) for tool in ("msmodelslim", "llmcompressor") for model in ("dense", "moe")
               for scheme in ("w8a8", "w8a8_dynamic")]
CHECKPOINTS += [("msmodelslim", "mla", "w8a8"), ("llmcompressor", "mla", "w8a8")]


def tensors(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor in the folder's safetensors files: name -> (dtype, shape), read from the files' own headers
    (8 bytes of little-endian length, then the JSON header)."""
    out: dict[str, tuple[str, list[int]]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        out.update({name: (t["dtype"], t["shape"]) for name, t in header.items() if name != "__metadata__"})
    return out


def stored_bytes(folder: Path) -> int:
    """The bytes of the tensors the model uses: all of them, less the LM head when the config ties it to the
    embedding (a tool may write both)."""
    config = json.loads((folder / "config.json").read_text())
    total = 0
    for name, (dtype, shape) in tensors(folder).items():
        if config.get("tie_word_embeddings") and name.startswith("lm_head."):
            continue
        numel = 1
        for n in shape:
            numel *= n
        total += numel * ITEMSIZE[dtype]
    return total


def int8_modules(folder: Path) -> dict[str, bool]:
    """Each linear-like module the tool wrote -> whether it stored its weight as int8."""
    return {name.removesuffix(".weight"): dtype == "I8" for name, (dtype, shape) in tensors(folder).items()
            if name.endswith(".weight") and len(shape) == 2}


@pytest.mark.parametrize(("tool", "model", "scheme"), CHECKPOINTS)
def test_the_scheme_read_is_the_one_the_tool_wrote(tool: str, model: str, scheme: str) -> None:
    folder = quant_checkpoint(tool, model, scheme)  # type: ignore[arg-type]
    spec = ModelSpec.from_pretrained(folder)
    q = spec.quantization
    assert q is not None
    assert q.format == ("msmodelslim" if tool == "msmodelslim" else "compressed-tensors")
    # the headline method, as the tool declares it
    if tool == "msmodelslim":
        description = json.loads((folder / "quant_model_description.json").read_text())
        assert q.method == description["model_quant_type"].lower()
    else:
        acts = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
        assert q.method == ("w8a8_dynamic" if acts["input_activations"]["dynamic"] else "w8a8")
        assert q.method == scheme
    # every module the tool stored as int8 is int8 in the scheme, every other one float (embedding, norms, router,
    # LM head)
    for module, is_int8 in int8_modules(folder).items():
        assert (q.module_method(module) is not None) == is_int8, module


@pytest.mark.parametrize(("tool", "model", "scheme"), CHECKPOINTS)
def test_weight_bytes_are_the_bytes_the_tool_stored(tool: str, model: str, scheme: str) -> None:
    folder = quant_checkpoint(tool, model, scheme)  # type: ignore[arg-type]
    spec = ModelSpec.from_pretrained(folder)
    real = stored_bytes(folder)
    assert spec.weight_bytes == pytest.approx(real, rel=0.01), (spec.weight_bytes, real)


def test_msmodelslim_moe_follows_its_qwen3_moe_practice() -> None:
    """Its Qwen3-30B-A3B W8A8 practice: attention static W8A8, the MLP (every expert) W8A8_DYNAMIC, the router and
    the LM head float."""
    q = ModelSpec.from_pretrained(quant_checkpoint("msmodelslim", "moe", "w8a8")).quantization
    assert q is not None and q.method == "w8a8"
    assert q.module_method("model.layers.0.self_attn.q_proj") == "w8a8"
    assert q.module_method("model.layers.1.self_attn.o_proj") == "w8a8"
    for expert in (0, 15):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert q.module_method(f"model.layers.1.mlp.experts.{expert}.{proj}") == "w8a8_dynamic"
    assert q.module_method("model.layers.0.mlp.gate") is None
    assert q.module_method("lm_head") is None


def test_msmodelslim_mindie_layout_reads_the_same() -> None:
    """MindIE's save names the description after the type; the scheme read is the one its entries declare."""
    folder = mindie_checkpoint()
    assert [p.name for p in folder.glob("quant_model_description*.json")] == ["quant_model_description_w8a8.json"]
    spec = ModelSpec.from_pretrained(folder)
    q = spec.quantization
    assert q is not None and (q.format, q.method) == ("msmodelslim", "w8a8")
    assert q.module_method("model.layers.0.mlp.down_proj") == "w8a8"
    assert spec.weight_bytes == pytest.approx(stored_bytes(folder), rel=0.01)


@pytest.mark.parametrize(("tool", "kind", "named"), [
    ("llmcompressor", "int4", "int4"),
    ("llmcompressor", "kv", "kv_cache_scheme"),
    ("msmodelslim", "w8a16", "W8A16"),
    ("msmodelslim", "kv", "C8"),
])
def test_refused_checkpoints_name_their_scheme(tool: str, kind: str, named: str) -> None:
    folder = refused_checkpoint(kind, tool)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedModelError, match=named):
        ModelSpec.from_pretrained(folder)
