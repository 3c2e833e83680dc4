"""Quantized checkpoints made by the real tools users run (issue 31): msModelSlim and llm-compressor, each in its
pinned virtualenv (tests/thirdparty/tools_venv.py), run on the CPU on a `npuserve model create-dummy` model and
calibrated on GSM8K questions with the dummy's own tokenizer. npuserve writes none of these files itself.

Cached like the tools' virtualenvs: under `cache_dir()/quant-checkpoints/<key>`, the key a hash of the tool's pins,
the quantizing script's text, the source preset, dtype and seed, the scheme and the calibration texts; built once
under a file lock, complete when its `.complete` marker is there. Standard library and subprocess only.

    python tests/quant_checkpoints.py llmcompressor dense w8a8     # prints the folder
    python tests/quant_checkpoints.py refused llmcompressor int4
    python tests/quant_checkpoints.py mindie
    python tests/quant_checkpoints.py suite                        # every checkpoint the test suite reads
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

if __package__ in (None, ""):  # run as a script: make `tests.thirdparty` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.thirdparty.tools_venv import TOOLS, cache_dir, ensure_tools, file_lock, in_background, log

Tool = Literal["msmodelslim", "llmcompressor"]
Model = Literal["dense", "moe", "mla"]
Scheme = Literal["w8a8", "w8a8_dynamic"]
RefusedKind = Literal["int4", "kv", "w8a16"]

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {tool: REPO / "tests" / "thirdparty" / f"quantize_{tool}.py" for tool in ("msmodelslim", "llmcompressor")}
# dense: Llama; moe: Qwen3-MoE; mla: DeepSeek-V3 (MoE and latent attention). bf16, as the real models ship.
PRESETS = {"dense": "tiny", "moe": "tiny-qwen3-moe", "mla": "tiny-deepseek-v3"}
SOURCE_DTYPE = "bfloat16"
SEED = 0
CALIBRATION_TEXTS = 32  # GSM8K questions: a few dozen, as the tools' examples calibrate with a small set
# the files the tokenizer needs, copied from the dummy when the tool does not write them (msModelSlim saves weights
# and its description only)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


def gsm8k_path() -> Path:
    """The GSM8K test file beside the repo (`<root>/../shared/datasets/gsm8k`, as in CI), or $GSM8K_TEST_JSONL."""
    return Path(os.environ.get("GSM8K_TEST_JSONL", REPO.parent / "shared/datasets/gsm8k/test.jsonl"))


def calibration_texts(n: int = CALIBRATION_TEXTS) -> list[str]:
    with gsm8k_path().open() as fh:
        return [json.loads(line)["question"] for line, _ in zip(fh, range(n), strict=False)]


def _tool_scheme(tool: Tool, model: Model, scheme: str) -> str:
    """The script's scheme argument: msModelSlim's MoE recipe is its Qwen3-MoE practice (static W8A8 with the MLP,
    experts included, dynamic), whatever the headline scheme asked."""
    if tool == "msmodelslim" and model != "dense" and scheme in ("w8a8", "w8a8_dynamic"):
        return "moe" if scheme == "w8a8" else scheme
    return scheme


def _key(tool: Tool, model: Model, scheme: str, texts: list[str]) -> str:
    parts = [*TOOLS[tool], SCRIPTS[tool].read_text(), PRESETS[model], SOURCE_DTYPE, SEED, scheme, texts]
    digest = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]
    return f"{tool}-{model}-{scheme}-{digest}"


def _source(model: Model) -> Path:
    """The dummy model the tools quantize, written once by the real `npuserve model create-dummy`."""
    root = cache_dir() / "quant-checkpoints" / f"source-{PRESETS[model]}-{SOURCE_DTYPE}-seed{SEED}"
    if (root / ".complete").exists():
        return root
    with file_lock(root.with_suffix(".lock")):
        if not (root / ".complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            # -P and a cwd outside the repo: the repo root's `operator/` would shadow the standard library
            subprocess.run([sys.executable, "-P", "-c", "import sys; from npuserve.cli import main; sys.exit(main())",
                            "model", "create-dummy", "--preset", PRESETS[model], "--out", str(root),
                            "--seed", str(SEED), "--dtype", SOURCE_DTYPE], check=True, stdout=subprocess.DEVNULL,
                           cwd=root.parent)
            (root / ".complete").write_text("")
    return root


def _entry(tool: Tool, model: Model, scheme: str, texts: list[str] | None = None) -> Path:
    """The cache folder of one checkpoint."""
    return cache_dir() / "quant-checkpoints" / _key(tool, model, scheme, texts or calibration_texts())


def _build(tool: Tool, model: Model, scheme: str) -> Path:
    texts = calibration_texts()
    root = _entry(tool, model, scheme, texts)
    if (root / ".complete").exists():
        return root
    venv = ensure_tools(tool)
    source = _source(model)
    with file_lock(root.with_suffix(".lock")):
        if (root / ".complete").exists():
            return root
        started = time.monotonic()
        log(f"quantizing {PRESETS[model]} with {tool} ({scheme}) into {root} (first use; a minute or so)")
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        calib = root.with_suffix(".calib.json")
        calib.write_text(json.dumps(texts))
        cmd = [str(venv / "bin" / "python"), "-P", str(SCRIPTS[tool]), str(source), str(root), scheme, str(calib)]
        nice = ["nice", "-n", "19"] if shutil.which("nice") else []
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
        # a scratch cwd: msModelSlim drops a features.npy there, and the repo root's `operator/` must stay off
        # sys.path
        scratch = root.with_suffix(".work")
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        proc = subprocess.run([*nice, *cmd], capture_output=True, text=True, env=env, cwd=scratch)
        shutil.rmtree(scratch, ignore_errors=True)
        (root.with_suffix(".log")).write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n" + (proc.stdout + proc.stderr)[-6000:])
        for name in ("config.json", *TOKENIZER_FILES):
            if (source / name).exists() and not (root / name).exists():
                shutil.copy2(source / name, root / name)
        seconds = round(time.monotonic() - started)
        (root / ".complete").write_text(json.dumps({"tool": tool, "pins": list(TOOLS[tool]), "model": PRESETS[model],
                                                    "scheme": scheme, "seconds": seconds}) + "\n")
        log(f"quantized {PRESETS[model]} with {tool} ({scheme}) in {seconds}s")
    return root


def quant_checkpoint(tool: Tool, model: Model, scheme: Scheme) -> Path:
    """A W8A8 model folder written by `tool` from the dummy `model` (config.json, the tokenizer, the safetensors and
    the tool's declaration). msModelSlim's MoE checkpoints follow its Qwen3-MoE practice: `w8a8` is static W8A8 with
    the MLP (the experts) W8A8_DYNAMIC."""
    return _build(tool, model, _tool_scheme(tool, model, scheme))


def source_model(model: Model) -> Path:
    """The unquantized bf16 dummy the tools quantize for `model` (a plain Hugging Face folder)."""
    return _source(model)


def refused_checkpoint(kind: RefusedKind, tool: Tool = "llmcompressor") -> Path:
    """A dense checkpoint npuserve must refuse by its scheme's name: `int4` (llm-compressor W4A16), `kv` (a quantized
    KV cache: llm-compressor's kv_cache_scheme, msModelSlim's C8), `w8a16` (msModelSlim weight-only int8)."""
    return _build(tool, "dense", kind)


def mindie_checkpoint() -> Path:
    """msModelSlim's dense static W8A8 saved in MindIE's layout (`quant_model_description_w8a8.json`) rather than
    vllm-ascend's (`quant_model_description.json`)."""
    return _build("msmodelslim", "dense", "w8a8-mindie")


# every checkpoint the suite reads: (tool, model, scheme) through quant_checkpoint, the refused ones, MindIE's layout
SUITE_CHECKPOINTS: tuple[tuple[Tool, Model, Scheme], ...] = (
    *((tool, model, scheme) for tool in ("msmodelslim", "llmcompressor") for model in ("dense", "moe")
      for scheme in ("w8a8", "w8a8_dynamic")),
    ("llmcompressor", "mla", "w8a8"), ("llmcompressor", "mla", "w8a8_dynamic"),
    ("msmodelslim", "mla", "w8a8"))  # refused: the tool drops the routers' e_score_correction_bias
SUITE_REFUSED: tuple[tuple[RefusedKind, Tool], ...] = (
    ("int4", "llmcompressor"), ("kv", "llmcompressor"), ("w8a16", "msmodelslim"), ("kv", "msmodelslim"))


def build_suite() -> None:
    """Every checkpoint the test suite reads (and so both tools' virtualenvs): what `prewarm` runs."""
    for tool, model, scheme in SUITE_CHECKPOINTS:
        quant_checkpoint(tool, model, scheme)
    for kind, tool in SUITE_REFUSED:
        refused_checkpoint(kind, tool)
    mindie_checkpoint()


def prewarm() -> subprocess.Popen[bytes] | None:
    """Starts `build_suite` in a process of its own at the lowest priority, unless every checkpoint is there: on a
    fresh machine the tools' virtualenvs and their runs take minutes, mostly downloads, which this overlaps with the
    tests that run before the W8A8 ones (those wait on the file locks and find the work done). Its output goes to
    `quant-checkpoints/prewarm.log` in the cache."""
    if _all_complete():
        return None
    return in_background([sys.executable, "-P", str(Path(__file__).resolve()), "suite"],
                         "quant-checkpoints/prewarm.log")


def _all_complete() -> bool:
    """Whether every suite checkpoint's cache entry is complete (cheap: hashes and stats, no tool runs)."""
    try:
        texts = calibration_texts()
    except OSError:  # no GSM8K beside the repo: the tests that need it say so themselves
        return True
    return all((_entry(tool, model, _tool_scheme(tool, model, scheme), texts) / ".complete").exists()
               for tool, model, scheme in SUITE_CHECKPOINTS)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args == ["suite"]:
        build_suite()
    elif args == ["mindie"]:
        print(mindie_checkpoint())
    elif args and args[0] == "refused":
        print(refused_checkpoint(args[2], args[1]))  # type: ignore[arg-type]
    else:
        print(quant_checkpoint(*args))  # type: ignore[arg-type]
