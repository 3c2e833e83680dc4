import json
from pathlib import Path

import pytest

from npuserve.mindie_config import EngineEnvironment, MindIEConfig, MindIEConfigError, minimal_config

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "mindie" / "config.json"


def test_example_round_trips_unchanged(tmp_path: Path) -> None:
    config = MindIEConfig.load(EXAMPLE)
    assert config.to_dict() == json.loads(EXAMPLE.read_text())
    config.save(tmp_path / "out.json")
    assert json.loads((tmp_path / "out.json").read_text()) == json.loads(EXAMPLE.read_text())


def test_example_values_are_read() -> None:
    config = MindIEConfig.load(EXAMPLE)
    assert config.model.worldSize == 2 and config.model.npuMemSize == 17
    assert config.schedule.maxBatchSize == 200 and config.schedule.supportSelectBatch
    assert config.BackendConfig.npuDeviceIds == [[0, 1]]


def test_defaults_are_mindies() -> None:
    schedule = minimal_config("/w").schedule
    assert (schedule.maxBatchSize, schedule.maxPrefillBatchSize, schedule.maxPrefillTokens) == (200, 50, 8192)
    assert (schedule.prefillTimeMsPerReq, schedule.decodeTimeMsPerReq) == (150, 50)
    assert (schedule.maxIterTimes, schedule.maxPreemptCount, schedule.cacheBlockSize) == (512, 0, 128)
    assert schedule.maxQueueDelayMicroseconds == 5000
    deploy = minimal_config("/w").deploy
    assert (deploy.maxSeqLen, deploy.maxInputTokenLen) == (2560, 2048)


def test_minimal_config_keeps_the_fields_that_must_agree_valid() -> None:
    """A short maxSeqLen and a small maxBatchSize are valid as given: the fields bound by them follow."""
    config = minimal_config("/models/tiny", max_seq_len=256, maxBatchSize=8, model={"worldSize": 2},
                            extensions={"chunkedPrefill": True})
    assert (config.model.modelName, config.model.modelWeightPath, config.model.worldSize) == ("tiny", "/models/tiny", 2)
    assert (config.deploy.maxSeqLen, config.deploy.maxInputTokenLen) == (256, 256)
    assert (config.schedule.maxIterTimes, config.schedule.maxPrefillTokens) == (256, 8192)
    assert config.schedule.maxPrefillBatchSize == 8 and config.extensions.chunkedPrefill
    given = minimal_config("/m", max_seq_len=12000, max_input_len=10000, maxIterTimes=100, maxPrefillBatchSize=4)
    assert (given.deploy.maxInputTokenLen, given.schedule.maxIterTimes) == (10000, 100)
    assert (given.schedule.maxPrefillTokens, given.schedule.maxPrefillBatchSize) == (10000, 4)


def test_max_prefill_batch_size_zero_means_max_batch_size() -> None:
    schedule = minimal_config("/w", maxPrefillBatchSize=0, maxBatchSize=64).schedule
    assert schedule.effective_max_prefill_batch_size == 64


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"maxBatchSize": 0}, "ScheduleConfig.maxBatchSize"),
        ({"maxQueueDelayMicroseconds": 499}, "ScheduleConfig.maxQueueDelayMicroseconds"),
        ({"maxQueueDelayMicroseconds": 1_000_001}, "ScheduleConfig.maxQueueDelayMicroseconds"),
        ({"prefillTimeMsPerReq": 1001}, "ScheduleConfig.prefillTimeMsPerReq"),
        ({"maxPrefillBatchSize": 300}, "maxPrefillBatchSize (300) must not exceed maxBatchSize"),
        ({"maxIterTimes": 4000}, "maxIterTimes (4000) must not exceed ModelDeployConfig.maxSeqLen"),
        ({"maxPrefillTokens": 1024}, "maxPrefillTokens (1024) must be at least"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(change: dict[str, int], field: str) -> None:
    config = MindIEConfig.load(EXAMPLE)
    with pytest.raises(MindIEConfigError) as excinfo:
        config.with_schedule(**change)
    assert field in str(excinfo.value)
    assert config.schedule.maxBatchSize == 200  # the running config is untouched


def test_model_config_ranges() -> None:
    data = json.loads(EXAMPLE.read_text())
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["npuMemSize"] = 0
    with pytest.raises(MindIEConfigError, match=r"ModelConfig\.0\.npuMemSize"):
        MindIEConfig.from_dict(data)
    data = json.loads(EXAMPLE.read_text())
    data["BackendConfig"]["ModelDeployConfig"]["maxInputTokenLen"] = 4096
    with pytest.raises(MindIEConfigError, match="maxInputTokenLen"):
        MindIEConfig.from_dict(data)


def test_malformed_json_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(MindIEConfigError, match="not valid JSON"):
        MindIEConfig.load(bad)


def test_npuserve_extensions_live_under_their_own_key() -> None:
    data = json.loads(EXAMPLE.read_text()) | {"npuserve": {"policy": "longest-output-first", "device": "cpu"}}
    config = MindIEConfig.from_dict(data)
    assert config.extensions.policy == "longest-output-first"
    assert config.to_dict()["npuserve"]["policy"] == "longest-output-first"
    with pytest.raises(MindIEConfigError, match=r"npuserve\.policy"):
        MindIEConfig.from_dict(data | {"npuserve": {"policy": "random"}})


def test_environment_defaults() -> None:
    env = EngineEnvironment.from_environ({})
    assert (env.recompute_threshold, env.use_mb_swapper, env.npu_memory_fraction) == (0.5, False, 0.8)


def test_environment_both_recompute_names_and_the_newer_wins() -> None:
    assert EngineEnvironment.from_environ({"MIES_RECOMPUTE_THRESHOLD": "0.3"}).recompute_threshold == 0.3
    assert EngineEnvironment.from_environ({"MINDIE_LLM_RECOMPUTE_THRESHOLD": "0.2"}).recompute_threshold == 0.2
    both = {"MINDIE_LLM_RECOMPUTE_THRESHOLD": "0.2", "MIES_RECOMPUTE_THRESHOLD": "0.3"}
    assert EngineEnvironment.from_environ(both).recompute_threshold == 0.2


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"MINDIE_LLM_RECOMPUTE_THRESHOLD": "1.0"}, "recompute_threshold"),
        ({"MIES_RECOMPUTE_THRESHOLD": "-0.1"}, "recompute_threshold"),
        ({"NPU_MEMORY_FRACTION": "1.5"}, "npu_memory_fraction"),
        ({"NPU_MEMORY_FRACTION": "lots"}, "NPU_MEMORY_FRACTION"),
    ],
)
def test_environment_out_of_range(environ: dict[str, str], message: str) -> None:
    with pytest.raises(MindIEConfigError, match=message):
        EngineEnvironment.from_environ(environ)


def test_swapper_flag_is_refused_when_set_and_accepted_when_off() -> None:
    with pytest.raises(MindIEConfigError, match="MIES_USE_MB_SWAPPER is set"):
        EngineEnvironment.from_environ({"MIES_USE_MB_SWAPPER": "1"})
    assert not EngineEnvironment.from_environ({"MIES_USE_MB_SWAPPER": "0"}).use_mb_swapper


@pytest.mark.parametrize(
    ("section", "change", "named"),
    [
        ("ScheduleConfig", {"prefillPolicyType": 1}, "ScheduleConfig.prefillPolicyType"),
        ("ScheduleConfig", {"decodePolicyType": 3}, "ScheduleConfig.decodePolicyType"),
        ("ScheduleConfig", {"templateType": "Mix"}, "ScheduleConfig.templateType"),
    ],
)
def test_settings_the_engine_does_not_honour_are_refused_by_name(section: str, change: dict[str, object],
                                                                 named: str) -> None:
    data = json.loads(EXAMPLE.read_text())
    if section == "npuserve":
        data["npuserve"] = change
    else:
        data["BackendConfig"][section].update(change)
    with pytest.raises(MindIEConfigError) as excinfo:
        MindIEConfig.from_dict(data)
    assert named in str(excinfo.value)


def test_max_batch_size_limit_bounds_max_batch_size_by_both_names() -> None:
    data = json.loads(EXAMPLE.read_text()) | {"npuserve": {"maxBatchSizeLimit": 256}}
    config = MindIEConfig.from_dict(data)  # maxBatchSize 200
    assert config.batch_size_limit == 256
    assert config.with_schedule(maxBatchSize=256).schedule.maxBatchSize == 256  # the limit itself is allowed
    with pytest.raises(MindIEConfigError) as excinfo:
        config.with_schedule(maxBatchSize=257)  # a live raise past it
    message = str(excinfo.value)
    assert "ScheduleConfig.maxBatchSize (257)" in message and "npuserve.maxBatchSizeLimit (256)" in message
    data["npuserve"]["maxBatchSizeLimit"] = 199  # a file whose maxBatchSize (200) is already past it
    with pytest.raises(MindIEConfigError, match=r"maxBatchSize \(200\) exceeds npuserve\.maxBatchSizeLimit \(199\)"):
        MindIEConfig.from_dict(data)
    data["npuserve"]["maxBatchSizeLimit"] = 5001  # maxBatchSize's own range
    with pytest.raises(MindIEConfigError, match=r"npuserve\.maxBatchSizeLimit"):
        MindIEConfig.from_dict(data)


def test_without_a_limit_the_engine_is_sized_for_the_start_up_max_batch_size() -> None:
    config = MindIEConfig.load(EXAMPLE)  # no npuserve section: a hand-written MindIE file
    assert config.batch_size_limit == 200
    assert config.with_schedule(maxBatchSize=300).schedule.maxBatchSize == 300  # the file alone bounds nothing
    running = config.with_batch_size_limit()  # what a started engine runs
    assert running.extensions.maxBatchSizeLimit == 200 and running.schedule == config.schedule
    with pytest.raises(MindIEConfigError, match=r"npuserve\.maxBatchSizeLimit \(200\)"):
        running.with_schedule(maxBatchSize=201)
    limited = MindIEConfig.from_dict(json.loads(EXAMPLE.read_text()) | {"npuserve": {"maxBatchSizeLimit": 400}})
    assert limited.with_batch_size_limit().extensions.maxBatchSizeLimit == 400  # a given limit is kept


@pytest.mark.parametrize(("change", "key"), [
    ({"stepTimeoutSeconds": 0}, "npuserve.stepTimeoutSeconds"),
    ({"stepTimeoutSeconds": "soon"}, "npuserve.stepTimeoutSeconds"),
    ({"stepTimeoutGraceSeconds": -1}, "npuserve.stepTimeoutGraceSeconds"),
])
def test_the_step_watchdog_keys_are_validated_naming_the_key(change: dict[str, object], key: str) -> None:
    data = json.loads(EXAMPLE.read_text())
    assert MindIEConfig.from_dict(data | {"npuserve": {"stepTimeoutSeconds": 60}}).extensions.stepTimeoutSeconds == 60
    with pytest.raises(MindIEConfigError, match=key.replace(".", r"\.")):
        MindIEConfig.from_dict(data | {"npuserve": change})
