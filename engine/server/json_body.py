"""Request bodies parsed strictly, with OpenAI-style 400s naming what is wrong (FastAPI's own parse errors are a bare
`{"detail": "There was an error parsing the body"}`):

- bytes that are not UTF-8: a 400 naming the offset of the first bad byte;
- JSON nested past the parser's depth: a 400 saying so, not a RecursionError;
- a lone surrogate (`"\\ud800"`, which JSON's escapes allow but no text encoding does; the tokenizer would raise on
  it): a 400 naming the field that holds it. Only bodies with a surrogate escape at all are walked, so the check
  costs one regex scan of the raw bytes.

Routers take it with `APIRouter(route_class=StrictJSONRoute)`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyError(HTTPException):
    """A body that cannot be read as JSON text, or holds a string no tokenizer can take; answered 400 naming the
    field (an HTTPException, so FastAPI's body parsing lets it through to its handler)."""

    def __init__(self, message: str, param: str = "body") -> None:
        super().__init__(status_code=400, detail=message)
        self.message = message
        self.param = param


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or key) holding a lone surrogate, None if there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found = _lone_surrogate(key, where) or _lone_surrogate(item, where)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (str, dict, list)):
                found = _lone_surrogate(item, f"{path}.{i}" if path else str(i))
                if found:
                    return found
    return None


def parse_json_body(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"the body is not valid UTF-8: byte 0x{body[e.start]:02x} at offset {e.start}") from e
    try:
        value = json.loads(text)
    except RecursionError as e:
        raise BodyError("the body nests JSON arrays or objects too deeply") from e
    # JSONDecodeError passes on: FastAPI answers it as a validation error (our handler: 400 naming the position)
    if _SURROGATE_ESCAPE.search(body):
        where = _lone_surrogate(value, "")
        if where is not None:
            raise BodyError(f"{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is "
                            "not text", param=where)
    return value


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict
