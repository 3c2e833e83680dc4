"""Property-based requests generated from the app's own OpenAPI schema: no input makes the server fail (5xx)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.server.conftest import running_server

SETTINGS = settings(max_examples=25, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])


def test_no_input_makes_a_server_error(tiny_model_dir: Path) -> None:
    # Small limits keep every generated request short: the point is the server's answers, not generation.
    with running_server(tiny_model_dir, admin_token="s3cret", max_seq_len=256, maxIterTimes=32) as s:
        schema = schemathesis.openapi.from_url(s.url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/generate",
                                                   "/generate_stream", "/admin/schedule", "/info", "/metrics"}
        for operation in operations:

            @SETTINGS
            @given(case=operation.as_strategy())
            def check(case: Any) -> None:
                case.call_and_validate(checks=[not_a_server_error], timeout=30)

            check()
