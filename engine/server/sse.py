"""Server-sent events as the OpenAI and TGI-style streaming routes send them: one `data:` line per event."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# Characters JSON leaves as they are but Python's str.splitlines() breaks lines at: a client that splits the stream
# that way (guidellm) read half an event. Escaped, the event is the same JSON on one line whatever splits it.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One event. Fields given explicitly are sent, null included (a chunk's `finish_reason` and `logprobs`, as in
    OpenAI's schema); fields left at their default are not."""
    data = payload.model_dump_json(exclude_unset=True) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data.translate(_LINE_BREAKS)}\n\n"
