"""Which HTTP status an output that ended in error gets: the server's fault (a crashed step) is 500, a request
that can never be served (longer than the whole KV cache) is 400."""

from npuserve.engine.output_processor import RequestOutput
from npuserve.engine.sequence import FinishReason
from npuserve.engine.server.async_engine import ENGINE_FAILURE_PREFIX
from npuserve.engine.server.state import error_status


def _output(reason: FinishReason | None, error: str | None) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=[], new_text="", new_logprobs=None, token_ids=[], text="",
                         num_prompt_tokens=1, finished=True, finish_reason=reason, error=error)


def test_normal_endings_are_not_errors() -> None:
    assert error_status(_output(FinishReason.LENGTH, None)) is None
    assert error_status(_output(FinishReason.STOP, None)) is None


def test_a_crashed_step_is_the_servers_fault() -> None:
    assert error_status(_output(FinishReason.ERROR, ENGINE_FAILURE_PREFIX + "RuntimeError: boom")) == 500


def test_a_request_that_cannot_fit_is_the_clients() -> None:
    assert error_status(_output(FinishReason.ERROR, "the prompt needs 900 blocks; the cache has 512")) == 400
