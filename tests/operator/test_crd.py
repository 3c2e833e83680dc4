"""The CRD and the pydantic models agree: same fields, same defaults, same rules, same verdict on every object."""

from __future__ import annotations

import copy
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from isvc_helpers import EXAMPLES, REPO, apply_defaults, cel_failures, load_yaml, unknown_fields
from pydantic import BaseModel, ValidationError

from npuserve.operator.crd import CRD_FILE, PRINTER_COLUMNS, build_crd, crd_yaml, write_crd
from npuserve.planning import api

K8S_VERSION = "1.30.0"


def test_committed_crd_is_generated_from_the_models() -> None:
    """The check; with NPUSERVE_UPDATE_CRD=1 it writes the CRD and its chart copy instead, and checks nothing."""
    if os.environ.get("NPUSERVE_UPDATE_CRD"):
        written = write_crd(REPO)
        pytest.skip(f"regenerated {', '.join(str(p.relative_to(REPO)) for p in written)}; run again without "
                    "NPUSERVE_UPDATE_CRD to check")
    assert (REPO / CRD_FILE).read_text() == crd_yaml(), (
        "regenerate: NPUSERVE_UPDATE_CRD=1 pytest tests/operator/test_crd.py")


def test_crd_is_a_valid_customresourcedefinition(crd: dict[str, Any]) -> None:
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
    version = crd["spec"]["versions"][0]
    assert crd["metadata"]["name"] == "inferenceservices.npuserve.io"
    assert crd["spec"]["group"] == "npuserve.io" and version["name"] == "v1alpha1"
    assert crd["spec"]["names"]["shortNames"] == ["nisvc"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def _structural_violations(node: dict[str, Any], path: str) -> list[str]:
    bad: list[str] = []
    forbidden = {"$ref", "anyOf", "oneOf", "allOf", "not", "definitions", "$defs", "title", "const", "nullable"}
    bad += [f"{path}: {key}" for key in forbidden & set(node)]
    if "type" not in node and not (
        node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-int-or-string")
    ):
        bad.append(f"{path}: no type")
    if node.get("additionalProperties") is False:
        bad.append(f"{path}: additionalProperties false")
    if "properties" in node and "additionalProperties" in node:
        bad.append(f"{path}: both properties and additionalProperties")
    for bound in ("exclusiveMinimum", "exclusiveMaximum"):
        if bound in node and not isinstance(node[bound], bool):
            bad.append(f"{path}: {bound} must be a boolean in OpenAPI v3.0")
    for key, sub in node.get("properties", {}).items():
        bad += _structural_violations(sub, f"{path}.{key}")
    if isinstance(node.get("additionalProperties"), dict):
        bad += _structural_violations(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        bad += _structural_violations(node["items"], f"{path}[]")
    if "default" in node:  # the API server validates defaults against their own schema
        jsonschema.Draft4Validator(node).validate(node["default"])
    return bad


def test_schema_is_structural(root_schema: dict[str, Any]) -> None:
    assert _structural_violations(root_schema, "") == []


def _schema_at(root: dict[str, Any], json_path: str) -> dict[str, Any] | None:
    node = root
    for part in re.sub(r"\[[^\]]*\]", "", json_path).strip(".").split("."):
        if node.get("type") == "array":
            node = node["items"]
        props = node.get("properties", {})
        if part not in props:
            return None
        node = props[part]
    return node


def test_printer_columns_and_scale_paths_exist(root_schema: dict[str, Any]) -> None:
    names = {c["name"] for c in PRINTER_COLUMNS}
    assert {"Cards", "MaxBatchSize", "TTFT", "TPOT", "SLO Met", "Phase", "Age"} <= names
    for column in PRINTER_COLUMNS:
        if column["jsonPath"].startswith(".metadata"):
            continue
        assert _schema_at(root_schema, column["jsonPath"]) is not None, column
    for path in (".spec.replicas", ".status.replicas", ".status.selector"):
        assert _schema_at(root_schema, path) is not None, path
    assert _schema_at(root_schema, ".status.conditions.type") is not None


def _rules(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    found = [(path, node, rule) for rule in node.get("x-kubernetes-validations", [])]
    for key, sub in node.get("properties", {}).items():
        found += _rules(sub, f"{path}.{key}")
    if "items" in node:
        found += _rules(node["items"], f"{path}[]")
    return found


def test_every_cel_rule_compiles_names_a_field_and_points_at_one(root_schema: dict[str, Any]) -> None:
    import celpy

    env = celpy.Environment()
    rules = _rules(root_schema)
    assert len(rules) >= 12
    for path, node, rule in rules:
        env.compile(rule["rule"])
        if "messageExpression" in rule:
            env.compile(rule["messageExpression"])
        assert rule["message"].startswith("spec."), rule
        if "fieldPath" in rule:
            assert _schema_at(node, rule["fieldPath"]) is not None, (path, rule)
        if "reason" in rule:
            assert rule["reason"] in {"FieldValueRequired", "FieldValueInvalid", "FieldValueForbidden",
                                      "FieldValueDuplicate"}


# num_attention_heads of each model's published HF config.json.
PUBLISHED_HEADS = {"llama3-8b": 32, "llama3-70b": 64, "qwen2.5-7b": 28, "qwq-32b": 40, "mistral-7b": 32}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_HEADS))
def test_preset_heads_rule_refuses_cards_that_do_not_divide_the_published_heads(
    preset: str, root_schema: dict[str, Any]
) -> None:
    heads = PUBLISHED_HEADS[preset]
    for cards in (1, 2, 3, 4, 5, 8, 16):
        obj = _mutated("model.preset", preset)
        obj["spec"]["accelerator"]["cards"] = cards
        failures = cel_failures(root_schema, apply_defaults(root_schema, obj))
        if heads % cards == 0:
            assert failures == [], (preset, cards)
        else:
            assert failures == [f"spec.accelerator.cards ({cards}) must divide the {heads} attention heads of "
                                f"spec.model.preset {preset}"], (preset, cards)


# --- the models and the schema have the same fields ---------------------------------------------------------------


def _model_classes(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += _model_classes(arg)
    return found


def _compare(model: type[BaseModel], node: dict[str, Any], path: str) -> None:
    if node.get("type") == "array":
        node = node["items"]
    props = node["properties"]
    assert set(model.model_fields) == set(props), path
    required = {name for name, f in model.model_fields.items() if f.is_required()}
    assert required == set(node.get("required", [])), path
    for name, field in model.model_fields.items():
        default = field.default
        if not field.is_required() and field.default_factory is None and default is not None:
            assert props[name].get("default") == default, f"{path}.{name}"
        for sub in _model_classes(field.annotation):
            child = props[name]
            if child.get("type") == "object" and "additionalProperties" in child:
                child = child["additionalProperties"]
            _compare(sub, child, f"{path}.{name}")
        origin = typing.get_origin(field.annotation)
        if origin in (typing.Union, types.UnionType):
            assert "anyOf" not in props[name]


def test_models_and_schema_have_the_same_fields_required_and_defaults(root_schema: dict[str, Any]) -> None:
    _compare(api.InferenceServiceSpec, root_schema["properties"]["spec"], "spec")
    _compare(api.InferenceServiceStatus, root_schema["properties"]["status"], "status")


def test_the_schema_accepts_the_catalog_names_and_refuses_others(root_schema: dict[str, Any]) -> None:
    accepted = {("model.preset", p) for p in ("llama3-8b", "llama3-70b", "qwen2.5-7b", "qwq-32b", "tiny")}
    accepted |= {("accelerator.type", a) for a in ("ascend-910b3", "ascend-910b4", "atlas-300i-duo",
                                                   "nvidia-h100-80gb")}
    for path, value in sorted(accepted):
        assert _crd_errors(root_schema, _mutated(path, value)) == [], value
    for path, value in (("model.preset", "llama-3-8b"), ("model.preset", "Llama3-8B"),
                        ("accelerator.type", "ascend-910c"), ("accelerator.type", "910b4")):
        assert _schema_errors(root_schema, _mutated(path, value)), value


def test_the_schema_takes_the_w8a8_schemes_and_refuses_others_naming_the_field(root_schema: dict[str, Any]) -> None:
    # the four schemes of issue 31: msModelSlim and compressed-tensors, W8A8 static and dynamic
    for fmt in ("msmodelslim", "compressed-tensors"):
        for method in ("w8a8", "w8a8_dynamic"):
            obj = _mutated("model.quantization", {"format": fmt, "method": method})
            assert _crd_errors(root_schema, obj) == [], (fmt, method)
            assert api.InferenceService.model_validate(obj).spec.model.quantization is not None
    # a KV cache scheme has no field: kubectl's strict field validation refuses it by name, the models too
    obj = _mutated("model.quantization", {"format": "msmodelslim", "method": "w8a8", "kvCache": "int8"})
    assert unknown_fields(root_schema, obj) == [".spec.model.quantization.kvCache"]
    with pytest.raises(ValidationError, match="kvCache"):
        api.InferenceService.model_validate(obj)
    # an int4 method, another format, a missing method
    for bad, field in (({"format": "msmodelslim", "method": "w4a8"}, "method"),
                       ({"format": "gptq", "method": "w8a8"}, "format"),
                       ({"format": "msmodelslim"}, "method")):
        obj = _mutated("model.quantization", bad)
        errors = list(jsonschema.Draft4Validator(root_schema).iter_errors(apply_defaults(root_schema, obj)))
        assert errors, bad
        assert any(field in [*map(str, e.path), e.message] or field in e.message for e in errors), (bad, errors)
        with pytest.raises(ValidationError, match=field):
            api.InferenceService.model_validate(obj)
    description = root_schema["properties"]["spec"]["properties"]["model"]["properties"]["quantization"]
    assert "KV cache quantization has no field" in description["description"]


# MindIE Server's documented ScheduleConfig ranges (its config.json reference; docs/mindie-config.md), written out here.
MINDIE_RANGES = {"maxBatchSize": (1, 5000), "maxQueueDelayMicroseconds": (500, 1_000_000),
                 "prefillTimeMsPerReq": (0, 1000), "decodeTimeMsPerReq": (0, 1000)}


@pytest.mark.parametrize("knob", sorted(MINDIE_RANGES))
def test_schedule_knobs_take_mindies_ranges(knob: str, root_schema: dict[str, Any]) -> None:
    low, high = MINDIE_RANGES[knob]
    for value, ok in ((low, True), (high, True), (low - 1, False), (high + 1, False)):
        obj = _mutated("engine", {"schedule": {knob: value}})
        assert (not _crd_errors(root_schema, obj)) == ok, (knob, value)


# --- examples are valid against both ------------------------------------------------------------------------------


def _schema_errors(root_schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """The OpenAPI schema's verdict alone (CEL rules are not evaluated: a value the schema refuses may break them)."""
    defaulted = apply_defaults(root_schema, obj)
    return [e.message for e in jsonschema.Draft4Validator(root_schema).iter_errors(defaulted)]


def _crd_errors(root_schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    return _schema_errors(root_schema, obj) + cel_failures(root_schema, apply_defaults(root_schema, obj))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid_against_the_models_and_the_crd(path: Path, root_schema: dict[str, Any]) -> None:
    obj = load_yaml(path)
    api.InferenceService.model_validate(obj)
    assert _crd_errors(root_schema, obj) == []
    assert unknown_fields(root_schema, obj) == []


def test_examples_cover_every_objective_and_a_multi_node_model() -> None:
    specs = [api.InferenceService.model_validate(load_yaml(p)).spec for p in EXAMPLES]
    assert {s.slo.objective for s in specs} == {"throughput", "decodeLatency", "firstTokenAndDecode"}
    assert any((s.accelerator.cards or 0) > 8 for s in specs)


def test_an_object_without_optional_sections_gets_the_documented_defaults(root_schema: dict[str, Any]) -> None:
    obj = load_yaml(REPO / "examples" / "tiny-cpu.yaml")
    for key in ("slo", "engine", "host", "monitoring", "autotune"):
        obj["spec"].pop(key, None)
    spec = apply_defaults(root_schema, obj)["spec"]
    # Autotuning is off unless asked for.
    assert spec["autotune"] == {"enabled": False, "mode": "online", "maxTrials": 8, "window": "2m",
                                "minSamples": 50, "innerLoop": False}
    assert spec["slo"] == {"objective": "throughput", "statistic": "mean"}
    assert spec["host"] == {"cpuPinning": "numa", "transparentHugePages": False, "jemalloc": True,
                            "cpuPerformanceGovernor": False}
    assert spec["monitoring"] == {"podMonitor": False, "interval": "15s"}
    assert spec["accelerator"]["memoryFraction"] == 0.8  # MindIE's NPU_MEMORY_FRACTION default
    assert spec["workload"]["maxOutputTokens"] == 64 and apply_defaults(
        root_schema, _mutated("workload", {"avgInputTokens": 186, "avgOutputTokens": 346}))["spec"]["workload"] == {
        "avgInputTokens": 186, "avgOutputTokens": 346, "maxOutputTokens": 512, "maxInputTokens": 2048}


def test_autotune_enabled_is_accepted_and_reported_not_refused(root_schema: dict[str, Any]) -> None:
    obj = _mutated("autotune", {"enabled": True})
    assert _crd_errors(root_schema, obj) == []
    assert api.InferenceService.model_validate(obj).spec.autotune.enabled is True


def test_crd_defaults_equal_the_model_defaults(root_schema: dict[str, Any]) -> None:
    obj = load_yaml(REPO / "examples" / "tiny-cpu.yaml")
    for key in ("slo", "engine", "host", "monitoring", "autotune"):
        obj["spec"].pop(key, None)
    defaulted = apply_defaults(root_schema, obj)["spec"]
    model = api.InferenceServiceSpec.model_validate(obj["spec"]).model_dump(exclude_none=True)
    for key in ("slo", "engine", "host", "monitoring", "autotune"):
        # An empty map or list in the model is an absent field in the API.
        assert defaulted[key] == {k: v for k, v in model[key].items() if v not in ({}, [])}, key


# --- invalid objects: refused by both, with the same message that names the field ------------------------------

BASE = load_yaml(REPO / "examples" / "llama3-8b-throughput.yaml")


def _both(path: str, value: Any, path2: str, value2: Any) -> dict[str, Any]:
    obj = _mutated(path, value)
    return _mutated(path2, value2, obj)


def _mutated(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    obj = copy.deepcopy(BASE if base is None else base)
    *parents, last = path.split(".")
    node = obj["spec"]
    for part in parents:
        node = node.setdefault(part, {})
    if value is _DELETE:
        node.pop(last, None)
    else:
        node[last] = value
    return obj


_DELETE = object()
ARCH = {"numLayers": 32, "hiddenSize": 4096, "numAttentionHeads": 32, "numKeyValueHeads": 8, "headDim": 128,
        "vocabSize": 128256, "intermediateSize": 14336}

CEL_CASES = {
    # The engine's TPOT controller holds a mean TPOT target: the inner loop needs a TPOT bound on the mean.
    "inner loop without a TPOT bound": (_mutated("autotune.innerLoop", True),
                                        "spec.autotune.innerLoop needs spec.slo.tpotMs"),
    "inner loop on a p90 bound": (_both("autotune.innerLoop", True, "slo",
                                        {"objective": "decodeLatency", "tpotMs": 50, "statistic": "p90"}),
                                  "spec.autotune.innerLoop needs spec.slo.statistic mean"),
    "preset and architecture": (_mutated("model.architecture", ARCH),
                                "spec.model: set exactly one of preset or architecture"),
    "neither preset nor architecture": (_mutated("model.preset", _DELETE),
                                        "spec.model: set exactly one of preset or architecture"),
    "two weight sources": (_mutated("model.weights.hostPath", {"path": "/m"}),
                           "spec.model.weights: set exactly one of pvc or hostPath"),
    "no weight source": (_mutated("model.weights", {}), "spec.model.weights: set exactly one of pvc or hostPath"),
    "dummy with a source": (_mutated("model.weights.loadFormat", "dummy"),
                            "spec.model.weights: set exactly one of pvc or hostPath"),
    "decodeLatency without tpotMs": (_mutated("slo", {"objective": "decodeLatency"}),
                                     "spec.slo.tpotMs is required when spec.slo.objective is decodeLatency"),
    "firstTokenAndDecode without ttftMs": (_mutated("slo", {"objective": "firstTokenAndDecode", "tpotMs": 50}),
                                           "spec.slo.ttftMs is required when spec.slo.objective is "
                                           "firstTokenAndDecode"),
    "firstTokenAndDecode without tpotMs": (_mutated("slo", {"objective": "firstTokenAndDecode", "ttftMs": 50}),
                                           "spec.slo.tpotMs is required when spec.slo.objective is "
                                           "firstTokenAndDecode"),
    "replicas outside capacity's bounds": (_both("replicas", 3, "capacity.maxReplicas", 2),
                                           "spec.replicas must lie within spec.capacity.minReplicas and maxReplicas"),
    "capacity bounds crossed": (_mutated("capacity", {"targetConcurrentUsers": 100, "minReplicas": 3,
                                                      "maxReplicas": 2}),
                                "spec.capacity.minReplicas must not exceed spec.capacity.maxReplicas"),
    "cards not dividing the preset's heads": (_mutated("accelerator.cards", 3),
                                              "spec.accelerator.cards (3) must divide the 32 attention heads of "
                                              "spec.model.preset llama3-8b"),
    "average output above the maximum": (_mutated("workload.avgOutputTokens", 600),
                                         "spec.workload.avgOutputTokens must not exceed"),
    "average input above the maximum": (_mutated("workload.avgInputTokens", 4096),
                                        "spec.workload.avgInputTokens must not exceed"),
    "reserved above memory": (_mutated("accelerator", {"type": "ascend-910b4", "memoryGiB": 8, "reservedGiB": 9}),
                              "spec.accelerator.reservedGiB must be less than"),
    "cpu without memory": (_mutated("accelerator", {"type": "cpu"}), "spec.accelerator.memoryGiB is required"),
    "cards spanning nodes not a multiple of cardsPerNode": (
        _mutated("accelerator", {"type": "ascend-910b4", "cards": 16, "cardsPerNode": 6}),
        "spec.accelerator.cards must be a multiple of spec.accelerator.cardsPerNode when it exceeds it"),
    "prefill batch above batch": (_mutated("engine", {"schedule": {"maxBatchSize": 10, "maxPrefillBatchSize": 20}}),
                                  "spec.engine.schedule.maxPrefillBatchSize must not exceed"),
}


def _arch_case(**changes: Any) -> dict[str, Any]:
    obj = _mutated("model.preset", _DELETE)
    obj["spec"]["model"]["architecture"] = {**ARCH, **changes}
    return obj


CEL_CASES["cards not dividing the architecture's heads"] = (
    (lambda o: (o["spec"]["accelerator"].update(cards=3), o)[1])(_arch_case()),
    "spec.accelerator.cards must divide spec.model.architecture.numAttentionHeads",
)
CEL_CASES["kv heads not dividing heads"] = (
    _arch_case(numKeyValueHeads=5),
    "spec.model.architecture.numAttentionHeads must be a multiple of numKeyValueHeads",
)

# A mixture of experts (Qwen3-30B-A3B's numbers) and latent attention with experts (DeepSeek-V3's).
ARCH_MOE = {"modelType": "qwen3_moe", "numLayers": 48, "hiddenSize": 2048, "numAttentionHeads": 32,
            "numKeyValueHeads": 4, "headDim": 128, "vocabSize": 151936, "intermediateSize": 6144,
            "numExperts": 128, "numExpertsPerToken": 8, "moeIntermediateSize": 768, "normTopkProb": True}
ARCH_MLA = {"modelType": "deepseek_v3", "numLayers": 61, "hiddenSize": 7168, "numAttentionHeads": 128,
            "numKeyValueHeads": 128, "vocabSize": 129280, "intermediateSize": 18432, "numExperts": 256,
            "numExpertsPerToken": 8, "moeIntermediateSize": 2048, "sharedExpertIntermediateSize": 2048,
            "firstDenseLayers": 3, "qLoraRank": 1536, "kvLoraRank": 512, "qkNopeHeadDim": 128, "qkRopeHeadDim": 64,
            "vHeadDim": 128}


def _without(arch: dict[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in arch.items() if k not in names}


MLA_FIELDS = ("qLoraRank", "kvLoraRank", "qkNopeHeadDim", "qkRopeHeadDim", "vHeadDim")
MOE_CEL_CASES = {
    "top-k above the experts": ({**ARCH_MOE, "numExpertsPerToken": 200},
                                "spec.model.architecture.numExpertsPerToken must not exceed numExperts"),
    "MoE fields partly set": (_without(ARCH_MOE, "moeIntermediateSize"),
                              "spec.model.architecture: set numExperts, numExpertsPerToken and moeIntermediateSize "
                              "together"),
    "experts on a dense model type": ({**ARCH, "numExperts": 8, "numExpertsPerToken": 2, "moeIntermediateSize": 64},
                                      "spec.model.architecture.numExperts (a mixture of experts) is required for "
                                      "modelType qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3 and refused"),
    "MoE model type without experts": ({**ARCH, "modelType": "qwen3_moe"},
                                       "spec.model.architecture.numExperts (a mixture of experts) is required"),
    "MoE option without experts": ({**ARCH, "normTopkProb": True},
                                   "spec.model.architecture: sharedExpertIntermediateSize, normTopkProb and "
                                   "firstDenseLayers need a mixture of experts"),
    "shared expert on qwen3_moe": ({**ARCH_MOE, "sharedExpertIntermediateSize": 768},
                                   "spec.model.architecture.sharedExpertIntermediateSize: qwen3_moe has no shared "
                                   "expert"),
    "DeepSeek shared experts not whole": ({**ARCH_MLA, "sharedExpertIntermediateSize": 3000},
                                          "spec.model.architecture.sharedExpertIntermediateSize"),
    "normTopkProb on deepseek_v2": ({**ARCH_MLA, "modelType": "deepseek_v2", "normTopkProb": True},
                                    "spec.model.architecture.normTopkProb: deepseek_v2 never renormalises"),
    "no MoE layer left": ({**ARCH_MOE, "firstDenseLayers": 48},
                          "spec.model.architecture.firstDenseLayers must be less than numLayers"),
    "MLA fields partly set": (_without(ARCH_MLA, "vHeadDim"),
                              "spec.model.architecture: set kvLoraRank, qkNopeHeadDim, qkRopeHeadDim and vHeadDim "
                              "together"),
    "MLA on a model type without it": ({**ARCH_MOE, "numKeyValueHeads": 32, "kvLoraRank": 512, "qkNopeHeadDim": 64,
                                        "qkRopeHeadDim": 64, "vHeadDim": 128},
                                       "spec.model.architecture.kvLoraRank (latent attention) is required for "
                                       "modelType deepseek_v2, deepseek_v3 and refused for the others"),
    "DeepSeek without MLA": (_without(ARCH_MLA, *MLA_FIELDS),
                             "spec.model.architecture.kvLoraRank (latent attention) is required"),
    "MLA with grouped key-value heads": ({**ARCH_MLA, "numKeyValueHeads": 64},
                                         "spec.model.architecture.numKeyValueHeads must equal numAttentionHeads with "
                                         "latent attention"),
    "MLA head size not nope + rope": ({**ARCH_MLA, "headDim": 128},
                                      "spec.model.architecture.headDim must be qkNopeHeadDim + qkRopeHeadDim"),
}
for _name, (_arch, _message) in MOE_CEL_CASES.items():
    _obj = _mutated("model.preset", _DELETE)
    _obj["spec"]["model"]["architecture"] = _arch
    CEL_CASES[_name] = (_obj, _message)


@pytest.mark.parametrize("arch", [ARCH_MOE, ARCH_MLA, {**ARCH_MLA, "modelType": "deepseek_v2", "normTopkProb": False},
                                  _without(ARCH_MLA, "qLoraRank", "headDim")], ids=["moe", "mla", "v2", "no-q-lora"])
def test_valid_moe_and_mla_architectures_pass_both(arch: dict[str, Any], root_schema: dict[str, Any]) -> None:
    obj = _mutated("model.preset", _DELETE)
    obj["spec"]["model"]["architecture"] = arch
    api.InferenceService.model_validate(obj)
    assert _crd_errors(root_schema, obj) == []


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "deepseek-v2-lite",
                                    "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-deepseek-v2-lite"])
def test_the_moe_and_mla_presets_written_inline_pass_both(preset: str, root_schema: dict[str, Any]) -> None:
    from npuserve.catalog.models import MODEL_PRESETS
    from npuserve.planning.planner import architecture_of

    obj = _mutated("model.preset", _DELETE)
    obj["spec"]["model"]["architecture"] = architecture_of(MODEL_PRESETS[preset]).model_dump(exclude_none=True)
    api.InferenceService.model_validate(obj)
    assert _crd_errors(root_schema, obj) == []


@pytest.mark.parametrize("case", sorted(CEL_CASES))
def test_invalid_object_is_refused_by_the_models_and_by_cel_alike(case: str, root_schema: dict[str, Any]) -> None:
    obj, message = CEL_CASES[case]
    with pytest.raises(ValidationError) as excinfo:
        api.InferenceService.model_validate(obj)
    assert message in str(excinfo.value)
    defaulted = apply_defaults(root_schema, obj)
    assert list(jsonschema.Draft4Validator(root_schema).iter_errors(defaulted)) == []  # CEL's job, not the schema's
    failures = cel_failures(root_schema, defaulted)
    assert len(failures) == 1 and message in failures[0], failures


def test_cel_message_expression_names_the_numbers(root_schema: dict[str, Any]) -> None:
    obj, _ = CEL_CASES["cards not dividing the preset's heads"]
    (message,) = cel_failures(root_schema, apply_defaults(root_schema, obj))
    assert message == "spec.accelerator.cards (3) must divide the 32 attention heads of spec.model.preset llama3-8b"


SCHEMA_CASES = {
    "zero cards": _mutated("accelerator.cards", 0),
    "unknown objective": _mutated("slo.objective", "fast"),
    "unknown preset": _mutated("model.preset", "gpt-5"),
    "unknown accelerator": _mutated("accelerator.type", "tpu-v5"),
    "bad window": _mutated("autotune.window", "two minutes"),
    "batch above MindIE's range": _mutated("engine.schedule", {"maxBatchSize": 6000}),
    "missing workload": _mutated("workload", _DELETE),
    "non-positive tpot": _mutated("slo", {"objective": "decodeLatency", "tpotMs": 0}),
    "zero cards per node": _mutated("accelerator.cardsPerNode", 0),
    "an interface name with a space": _mutated("engine.socketInterface", "eth 0"),
    "an interface name over 15 characters": _mutated("engine.socketInterface", "a-very-long-nic-name"),
}


@pytest.mark.parametrize(("accelerator", "ok"), [
    ({"type": "cpu", "cards": 2, "cardsPerNode": 1, "memoryGiB": 2, "reservedGiB": 0}, True),  # the e2e test's
    ({"type": "ascend-910b4", "cards": 16, "cardsPerNode": 8}, True),  # two whole nodes
    ({"type": "ascend-910b4", "cards": 4, "cardsPerNode": 8}, True),  # within one node: any count
    ({"type": "ascend-910b4", "cards": 12, "cardsPerNode": 8}, False),  # a node and a half
    ({"type": "ascend-910b4", "cardsPerNode": 3}, True),  # the planner picks a multiple
])
def test_cards_per_node_is_checked_alike_by_the_models_and_cel(accelerator: dict[str, Any], ok: bool,
                                                                root_schema: dict[str, Any]) -> None:
    obj = _mutated("accelerator", accelerator)
    failures = _crd_errors(root_schema, obj)
    try:
        api.InferenceService.model_validate(obj)
        model_ok = True
    except ValidationError:
        model_ok = False
    assert (failures == [], model_ok) == (ok, ok), failures


def test_a_named_interface_is_accepted_by_both(root_schema: dict[str, Any]) -> None:
    for value in ("eth0", "enp189s0f0", "eth0,eth1", "bond0.100"):
        obj = _mutated("engine.socketInterface", value)
        assert _crd_errors(root_schema, obj) == [], value
        assert api.InferenceService.model_validate(obj).spec.engine.socketInterface == value


@pytest.mark.parametrize("case", sorted(SCHEMA_CASES))
def test_schema_violations_are_refused_by_both(case: str, root_schema: dict[str, Any]) -> None:
    obj = SCHEMA_CASES[case]
    with pytest.raises(ValidationError):
        api.InferenceService.model_validate(obj)
    assert list(jsonschema.Draft4Validator(root_schema).iter_errors(apply_defaults(root_schema, obj)))


def test_metadata_name_rules_agree(root_schema: dict[str, Any]) -> None:
    for name, ok in (("llama3-8b", True), ("8b-llama", False), ("x" * 46, False), ("Upper", False)):
        obj = copy.deepcopy(BASE)
        obj["metadata"]["name"] = name
        crd_ok = not list(jsonschema.Draft4Validator(root_schema).iter_errors(obj))
        try:
            api.InferenceService.model_validate(obj)
            model_ok = True
        except ValidationError:
            model_ok = False
        assert crd_ok == model_ok == ok, name


def test_the_generated_schema_refuses_and_accepts_concrete_objects() -> None:
    """The schema `build_crd()` makes now (not only the committed file) judges objects."""
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _crd_errors(schema, copy.deepcopy(BASE)) == []
    for case in ("zero cards", "unknown accelerator", "batch above MindIE's range"):
        assert _schema_errors(schema, SCHEMA_CASES[case]), case
    obj, message = CEL_CASES["replicas outside capacity's bounds"]
    assert any(message in e for e in _crd_errors(schema, obj))
