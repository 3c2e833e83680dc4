import pytest

from npuserve.catalog import ACCELERATORS, MODEL_PRESETS, get_accelerator, get_model_preset
from npuserve.catalog.accelerators import GIB
from npuserve.catalog.models import UnknownPresetError

# Published parameter counts (model cards / papers).
PUBLISHED_PARAMETERS = {
    "llama2-7b": 6.74e9,
    "llama2-13b": 13.0e9,
    "llama2-70b": 69.0e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "qwen2.5-7b": 7.61e9,
    "qwen2.5-14b": 14.7e9,
    "qwen2.5-32b": 32.5e9,
    "qwen2.5-72b": 72.7e9,
    "qwq-32b": 32.8e9,
    "qwen3-8b": 8.2e9,
    "qwen3-14b": 14.8e9,  # the Qwen3-14B model card: 14.8B parameters
    "qwen3-32b": 32.8e9,
    "mistral-7b": 7.24e9,
    # model cards: total parameters, every expert counted (the MTP layer of DeepSeek-V3 excluded: 671B + 14B)
    "qwen3-30b-a3b": 30.5e9,
    "qwen3-235b-a22b": 235e9,
    "deepseek-v3": 671e9,
    "deepseek-v2-lite": 15.7e9,
}

# Model cards: activated parameters per token, and whether the card counts the embedding table in them
# (`active_parameters` does not: a lookup is no compute). DeepSeek-V2-Lite's card gives 2.4B without it.
PUBLISHED_ACTIVE = {"qwen3-30b-a3b": (3.3e9, True), "qwen3-235b-a22b": (22e9, True), "deepseek-v3": (37e9, True),
                    "deepseek-v2-lite": (2.4e9, False)}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_parameter_count_matches_published_size(name: str) -> None:
    computed = get_model_preset(name).num_parameters
    published = PUBLISHED_PARAMETERS[name]
    assert abs(computed - published) / published < 0.015, f"{name}: {computed:.4g} vs {published:.4g}"


def test_every_real_preset_has_a_published_size() -> None:
    assert {name for name in MODEL_PRESETS if not name.startswith("tiny")} == set(PUBLISHED_PARAMETERS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE))
def test_active_parameters_match_the_published_activated_size(name: str) -> None:
    spec = get_model_preset(name)
    published, with_embeddings = PUBLISHED_ACTIVE[name]
    computed = spec.active_parameters + (spec.vocab_size * spec.hidden_size if with_embeddings else 0)
    assert abs(computed - published) / published < 0.03, f"{name}: {computed:.4g} vs {published:.4g}"


def test_llama3_8b_weights_are_about_15_gb_as_in_the_guide() -> None:
    # The MindIE guide's worked example counts LLaMA3-8B as 15 GB of bf16 weights.
    assert round(get_model_preset("llama3-8b").weight_bytes / GIB) == 15


def test_tiny_is_small() -> None:
    assert get_model_preset("tiny").weight_bytes < 10 * 1024**2


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(UnknownPresetError, match="llama3-8b"):
        get_model_preset("gpt-5")


def test_accelerators_memory_and_idle_figures_from_the_guide() -> None:
    b3 = get_accelerator("ascend-910b3")
    assert b3.memory_bytes == 64 * GIB and b3.idle_memory_bytes == int(3.4 * GIB)
    assert get_accelerator("ascend-910b4").memory_bytes == 32 * GIB
    assert b3.resource_name == "huawei.com/Ascend910"
    assert get_accelerator("nvidia-h100-80gb").resource_name == "nvidia.com/gpu"


def test_every_figure_names_its_source_and_fitted_fractions_stay_apart() -> None:
    for name, acc in ACCELERATORS.items():
        if name == "cpu":
            assert acc.peak_tflops_16bit is None and acc.memory_bandwidth_gbps is None  # fitted on the machine
            continue
        assert acc.source and acc.link is not None, name
        assert not any(f.startswith("fitted") for f in type(acc).model_fields), name  # no fitted field on a card
    # the 910B variants: Huawei's own performance model's tiers (msmodeling), the variant mapping said to be assumed
    assert all("msmodeling" in ACCELERATORS[f"ascend-910b{i}"].source for i in range(1, 5))
    assert all("assumed" in ACCELERATORS[f"ascend-910b{i}"].source or "only 32 GB" in
               ACCELERATORS[f"ascend-910b{i}"].source for i in range(1, 5))


def test_unknown_accelerator() -> None:
    with pytest.raises(KeyError, match="ascend-910b3"):
        get_accelerator("tpu-v5")
