"""The server driven by the official `openai` client: completions and chat, streamed and not."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import RunningServer


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models(client: openai.OpenAI, server: RunningServer) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [server.engine.engine.model_name]


def test_completion_usage_and_timings(client: openai.OpenAI, server: RunningServer) -> None:
    model = server.engine.engine.model_name
    prompt = "The capital of France is"
    result = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    prompt_tokens = len(server.engine.engine.encode(prompt))
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (prompt_tokens, 12)
    assert result.usage.total_tokens == prompt_tokens + 12
    assert result.choices[0].finish_reason == "length"
    timings = (result.model_extra or {})["npuserve"]
    assert timings["prefill_batch_size"] >= 1 and timings["ttft_ms"] > 0 and timings["queue_time_ms"] >= 0


def test_greedy_is_deterministic_and_streaming_matches(client: openai.OpenAI, server: RunningServer) -> None:
    model = server.engine.engine.model_name
    kwargs = dict(model=model, prompt="Simple is better than", max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    again = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    assert full == again
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))  # type: ignore[call-overload]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and (finals[0].model_extra or {}).get("npuserve", {}).get("prefill_batch_size") >= 1


def test_token_id_prompt_and_batched_prompts(client: openai.OpenAI, server: RunningServer) -> None:
    model = server.engine.engine.model_name
    ids = server.engine.engine.encode("hello world")
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    by_text = client.completions.create(model=model, prompt="hello world", max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=model, prompt=["hello world", "The quick"], max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage is not None and batch.usage.completion_tokens == 10


def test_logprobs_of_chosen_tokens(client: openai.OpenAI, server: RunningServer) -> None:
    result = client.completions.create(model=server.engine.engine.model_name, prompt="hello", max_tokens=4,
                                       temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and len(logprobs.token_logprobs or []) == 4
    assert all(lp <= 0 for lp in logprobs.token_logprobs or [])
    assert "".join(logprobs.tokens or []) == result.choices[0].text


def test_seeded_sampling_repeats(client: openai.OpenAI, server: RunningServer) -> None:
    kwargs = dict(model=server.engine.engine.model_name, prompt="Once", max_tokens=10, temperature=1.0, top_p=0.9,
                  seed=1234, extra_body={"ignore_eos": True, "top_k": 50})
    a = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    b = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    assert a == b


def test_stop_string_ends_the_text(client: openai.OpenAI, server: RunningServer) -> None:
    model = server.engine.engine.model_name
    base = client.completions.create(model=model, prompt="The weather", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[3:5]
    assert stop.strip(), "pick a prompt whose greedy text has a visible stop string"
    cut = client.completions.create(model=model, prompt="The weather", max_tokens=20, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == base[: base.index(stop)] and cut.finish_reason == "stop"


def test_chat_streamed_and_not(client: openai.OpenAI, server: RunningServer) -> None:
    model = server.engine.engine.model_name
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                          extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant" and full.usage is not None
    template = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert full.usage.prompt_tokens == len(server.engine.engine.encode(template))
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_chat_max_completion_tokens_and_logprobs(client: openai.OpenAI, server: RunningServer) -> None:
    result = client.chat.completions.create(model=server.engine.engine.model_name,
                                            messages=[{"role": "user", "content": "x"}], max_completion_tokens=3,
                                            temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    assert result.usage is not None and result.usage.completion_tokens == 3
    assert result.choices[0].logprobs is not None and len(result.choices[0].logprobs.content or []) == 3


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 100000}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_parameters_are_400_naming_the_field(client: openai.OpenAI, server: RunningServer,
                                                  kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model=server.engine.engine.model_name, prompt="hi", **kwargs)  # type: ignore[call-overload]
    assert excinfo.value.status_code == 400
    body = excinfo.value.body
    assert isinstance(body, dict) and body["param"] == param and param in body["message"]


def test_unknown_model_is_404_naming_the_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert isinstance(excinfo.value.body, dict) and excinfo.value.body["param"] == "model"


def test_prompt_beyond_max_input_len(client: openai.OpenAI, server: RunningServer) -> None:
    max_input = server.engine.engine.config.deploy.maxInputTokenLen
    with pytest.raises(openai.BadRequestError, match="maxInputTokenLen"):
        client.completions.create(model=server.engine.engine.model_name, prompt=[5] * (max_input + 1), max_tokens=2)
