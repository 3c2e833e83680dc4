"""The operator-engine contract (npuserve/engine_contract.py): defined once, and every schema takes it from there."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from npuserve import engine_contract as contract
from npuserve.catalog.models import get_model_preset
from npuserve.mindie_config import ScheduleSection

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("npuserve", "engine", "operator", "loadgen", "sim")

# MindIE's shipped ScheduleConfig defaults and documented ranges (docs/mindie-config.md), written out here on purpose.
MINDIE_DEFAULTS = {"cacheBlockSize": 128, "maxPrefillBatchSize": 50, "maxPrefillTokens": 8192,
                   "prefillTimeMsPerReq": 150, "decodeTimeMsPerReq": 50, "maxBatchSize": 200, "maxIterTimes": 512,
                   "maxPreemptCount": 0, "supportSelectBatch": False, "maxQueueDelayMicroseconds": 5000}


# MindIE 2.3's SLO scheduling fields (MindIE-LLM docs, user_guide/feature/slo_aware_scheduling_optimization.md).
MINDIE_SLO_DEFAULTS = {"stageSelectPolicy": 0, "dynamicBatchSizeEnable": False, "decodeExpectedTime": 50}


def _schemas() -> dict[str, type[BaseModel]]:
    from npuserve.engine.server.protocol import ScheduleUpdate
    from npuserve.planning.api import PlanSchedule, ScheduleKnobs

    return {"config.json": ScheduleSection, "CRD spec.engine.schedule": ScheduleKnobs, "plan": PlanSchedule,
            "PUT /admin/schedule": ScheduleUpdate}


def _bounds(prop: dict[str, Any]) -> tuple[Any, Any]:
    """minimum/maximum of a JSON-schema property (through anyOf for optional fields)."""
    for variant in [prop, *prop.get("anyOf", [])]:
        if "minimum" in variant or "maximum" in variant or variant.get("type") in ("integer", "boolean"):
            return variant.get("minimum"), variant.get("maximum")
    return None, None


def test_mindie_defaults_and_ranges() -> None:
    assert {f.name: f.default for f in contract.SCHEDULE_FIELDS} == MINDIE_DEFAULTS | MINDIE_SLO_DEFAULTS | {
        "prefillPolicyType": 0, "decodePolicyType": 0}
    by_name = contract.SCHEDULE_FIELD_BY_NAME
    assert (by_name["decodeExpectedTime"].ge, by_name["decodeExpectedTime"].le) == (1, 10000)  # MindIE: 0 .. 10000
    assert (by_name["maxQueueDelayMicroseconds"].ge, by_name["maxQueueDelayMicroseconds"].le) == (500, 1_000_000)
    assert (by_name["maxBatchSize"].ge, by_name["maxBatchSize"].le) == (1, 5000)
    assert {"cacheBlockSize"} == contract.RESTART_SCHEDULE_FIELDS
    assert ScheduleSection().model_dump(include=set(MINDIE_DEFAULTS)) == MINDIE_DEFAULTS


@pytest.mark.parametrize("where", ["config.json", "CRD spec.engine.schedule", "plan", "PUT /admin/schedule"])
def test_every_schedule_schema_takes_its_ranges_from_the_table(where: str) -> None:
    schema = _schemas()[where].model_json_schema()["properties"]
    for name, prop in schema.items():
        if name in ("templateType", "templateName", contract.SCHEDULE_GENERATION_KEY):
            continue  # the generation: test_the_schedule_generation_is_one_field_everywhere
        field = contract.SCHEDULE_FIELD_BY_NAME[name]  # a field outside the table is a second definition
        assert _bounds(prop) == (field.ge, field.le), f"{where}: {name}"


def test_which_schema_has_which_fields() -> None:
    schemas = _schemas()
    assert set(schemas["PUT /admin/schedule"].model_fields) == contract.HOT_SCHEDULE_FIELDS | {
        contract.SCHEDULE_GENERATION_KEY}
    assert set(schemas["CRD spec.engine.schedule"].model_fields) == set(contract.SCHEDULE_KNOBS)
    assert set(schemas["config.json"].model_fields) >= set(contract.SCHEDULE_FIELD_BY_NAME)


def test_the_schedule_generation_is_one_field_everywhere() -> None:
    """config.json's npuserve section, the PUT body, /info and status.tuning.applied carry the generation under the
    contract's key, with the contract's field (its range and description)."""
    from npuserve.engine.server.protocol import ScheduleUpdate
    from npuserve.mindie_config import NpuserveExtensions
    from npuserve.planning.api import AppliedSchedule

    assert contract.SCHEDULE_GENERATION_KEY == "scheduleGeneration"
    reference = contract.schedule_generation_field()
    for model in (NpuserveExtensions, ScheduleUpdate, contract.EngineInfo, AppliedSchedule):
        field = model.model_fields[contract.SCHEDULE_GENERATION_KEY]
        assert field.description == reference.description, model
        assert [m.ge for m in field.metadata if hasattr(m, "ge")] == [0], model


def test_the_crd_on_disk_carries_the_table_ranges() -> None:
    crd = yaml.safe_load((ROOT / "deploy" / "crds" / "inferenceservices.npuserve.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    knobs = spec["properties"]["engine"]["properties"]["schedule"]["properties"]
    assert set(knobs) == set(contract.SCHEDULE_KNOBS)
    for name, prop in knobs.items():
        field = contract.SCHEDULE_FIELD_BY_NAME[name]
        assert (prop.get("minimum"), prop.get("maximum")) == (field.ge, field.le), name


def test_kv_bytes_per_block() -> None:
    llama3 = dict(num_layers=32, block_size=128, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert contract.kv_bytes_per_block(**llama3) == 16 * 1024 * 1024  # 2 x 32 x 128 x 8 x 128 x 2 bytes
    assert contract.kv_bytes_per_block(**llama3, world_size=2) == 8 * 1024 * 1024  # kv heads split over 2 cards
    assert contract.kv_bytes_per_block(**llama3, world_size=16) == 2 * 1024 * 1024  # fewer heads: replicated
    assert get_model_preset("llama3-8b").kv_bytes_per_block(128, 2) == 8 * 1024 * 1024


def test_unservable_names_what_is_missing() -> None:
    assert contract.unservable("cpu", 1) is None
    assert contract.unservable("npu", 8) is None and contract.unservable("cuda", 4) is None  # one pod, many cards
    assert "device 'tpu'" in (contract.unservable("tpu", 1) or "")
    # A replica whose ranks span pods is served: the layout refuses nothing, on any device the engine has.
    assert contract.unservable("cpu", 2, nodes=2) is None and contract.unservable("npu", 32, 4) is None
    assert contract.unservable("tpu", 16, nodes=2) == (
        "the bundled engine cannot serve device 'tpu': it has backends for cpu, cuda, npu only")


def _literal_defined_in(literal: str) -> list[str]:
    pattern = re.compile(re.escape(f'"{literal}"'))
    return sorted(str(p.relative_to(ROOT)) for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")
                  if pattern.search(p.read_text()))


@pytest.mark.parametrize("literal", [
    contract.ADMIN_TOKEN_ENV, contract.CPU_BINDING_ENV, contract.NUMA_NODE_ENV, contract.RANK_NUMA_NODES_ENV,
    contract.LWS_GROUP_SIZE_ENV, contract.LWS_WORKER_INDEX_ENV, contract.LWS_LEADER_ADDRESS_ENV,
    contract.FLAG_NNODES, contract.FLAG_NODE_RANK, contract.FLAG_MASTER_ADDR, contract.FLAG_MASTER_PORT,
    contract.USE_MB_SWAPPER_ENV,
    contract.NPU_MEMORY_FRACTION_ENV, *contract.RECOMPUTE_THRESHOLD_ENVS, contract.FLAG_CONFIG,
    contract.ADMIN_SCHEDULE_PATH, contract.INFO_PATH,
])
def test_each_contract_name_is_spelled_once(literal: str) -> None:
    assert _literal_defined_in(literal) == ["npuserve/engine_contract.py"]


@pytest.mark.parametrize("metric", contract.ENGINE_METRICS, ids=lambda m: m.name)
def test_each_metric_name_is_spelled_once(metric: contract.EngineMetric) -> None:
    assert _literal_defined_in(metric.name) == ["npuserve/engine_contract.py"]


def test_no_metric_name_is_spelled_outside_the_contract() -> None:
    # Catches a second definition built another way (a prefix constant plus a name, an exported `_total` series).
    literal = re.compile(r"""["']npuserve:\w""")
    spelled = sorted(str(p.relative_to(ROOT)) for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")
                     if literal.search(p.read_text()))
    assert spelled == ["npuserve/engine_contract.py"]


def test_the_engine_exports_every_contract_metric_and_finish_reason() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from npuserve.engine.sequence import FinishReason
    from npuserve.engine.server.metrics import EngineMetrics

    text = EngineMetrics("probe").render().decode()
    series = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for metric in contract.ENGINE_METRICS:
        if metric.kind == "histogram":
            assert {metric.bucket, metric.sum_series, metric.count_series} <= series, metric.name
        else:
            assert metric.series in series, metric.name
    assert tuple(r.value for r in FinishReason) == contract.FINISHED_REASONS
    reasons = {s.labels.get(contract.METRIC_LABEL_FINISHED_REASON) for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == contract.METRIC_REQUEST_SUCCESS.series}
    assert reasons == set(contract.FINISHED_REASONS)


def test_contracts_import_no_part_and_no_torch() -> None:
    """At run time; tests/test_import_directions.py reads every arrow from the source."""
    modules = sorted(f"npuserve.{p.stem}" for p in (ROOT / "npuserve").glob("*.py") if p.stem != "__init__")
    parts = [["npuserve", p] for p in ("engine", "operator", "loadgen", "sim")]
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' "
            f"or m.split('.')[:2] in {parts!r})\nprint(bad)")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_operators_bench_command_is_what_npuserve_bench_parses() -> None:
    """The benchmark Job's command line (npuserve/bench_contract.py) against the load generator's real parser."""
    import argparse

    from npuserve.bench_contract import bench_command
    from npuserve.loadgen import bench_cli

    command = bench_command(base_url="http://10.0.0.1:8000", model="m", input_len=64, output_len=32, concurrency=7,
                            duration_s=30.5, num_prompts=100, request_timeout_s=150, tokenizer="/models")
    assert command[:2] == ["npuserve", "bench"]
    parser = argparse.ArgumentParser()
    bench_cli.configure(parser)
    args = parser.parse_args(command[2:])
    assert (args.base_url, args.model, args.tokenizer) == ("http://10.0.0.1:8000", "m", "/models")
    assert args.ignore_eos is True
    assert (args.dataset_name, args.random_input_len, args.random_output_len) == ("random", 64, 32)
    assert (args.max_concurrency, args.duration, args.num_prompts, args.request_timeout) == (7, 30.5, 100, 150.0)
