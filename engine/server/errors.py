"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`, which the `openai` client reads."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
          409: "ConflictError", 413: "RequestTooLargeError", 422: "UnprocessableEntityError", 429: "RateLimitError",
          503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "APIError"), "param": param,
                      "code": code or status}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.status, error.message, error.param, error.code), status_code=error.status,
                        headers=error.headers)


async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


def _field_path(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    # Union members show up as pseudo-fields (`str`, `list[int]`): keep the field the client named.
    while parts and ("[" in parts[-1] or parts[-1] in {"str", "int", "float", "bool"}):
        parts.pop()
    return ".".join(parts) or "body"


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Pydantic validation errors become 400 naming the field (OpenAI and vLLM answer 400, not 422)."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
    param = _field_path(tuple(first.get("loc", ())))
    ctx = first.get("ctx")
    cause = ctx.get("error") if isinstance(ctx, dict) else None
    field = getattr(cause, "field", None)  # protocol.UnsupportedField, refused by name
    if isinstance(field, str) and param.rsplit(".", 1)[-1] == field:  # a field's own validator: it is named
        message = str(cause)
    elif isinstance(field, str):
        message = str(cause) if param == "body" else f"{param}.{cause}"
        param = field if param == "body" else f"{param}.{field}"
    elif first.get("type") == "extra_forbidden":
        message = f"{param} is not a field of this request (nothing is ignored: remove it)"
    elif first.get("type") == "json_invalid":
        ctx = first.get("ctx")
        detail = ctx.get("error") if isinstance(ctx, dict) else None
        message = f"the body is not valid JSON: {detail or first.get('msg')}"
        param = "body"
    elif first.get("type") == "missing":
        message = f"{param} is required"
    else:
        message = f"{param}: {first.get('msg')}"
    status = 422 if request.url.path.startswith("/admin/") else 400
    return JSONResponse(error_body(status, message, param), status_code=status)


async def body_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """A body that is not UTF-8 JSON text (json_body.BodyError): 400 naming the field."""
    message, param = getattr(exc, "message", str(exc)), getattr(exc, "param", "body")
    return JSONResponse(error_body(400, message, param), status_code=400)
