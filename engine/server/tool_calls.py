"""Tool calls in the Hermes/Qwen format: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

`parse` reads them out of a finished output (the text before the first call is the message's content);
`ToolCallStream` does the same incrementally for a stream, holding back text that may open a call and sending each
call as one delta once it is closed. For `tool_choice: "required"` and a named function the output is constrained
instead (as vLLM does): `required_schema` (a JSON array of {"name", "parameters"} objects, one tool's parameters
each) and the named function's parameters schema go through the structured-output path, and
`parse_required` / the raw text give the calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _call_of(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls). If a `<tool_call>` block is not a JSON object with a name, the whole text is content."""
    start = text.find(OPEN)
    if start == -1:
        return text, []
    calls = []
    for match in _CALL.finditer(text, start):
        call = _call_of(match.group(1).strip())
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def parse_required(text: str) -> list[ParsedCall]:
    """The calls of a `tool_choice: "required"` output (a JSON array of {"name", "parameters"})."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    return [ParsedCall(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False))
            for i in items if isinstance(i, dict) and isinstance(i.get("name"), str)]


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for `tool_choice: "required"`: one or more calls (just one when parallel_tool_calls is
    false), each naming one of the tools with arguments valid against its parameters."""
    variants = [{"type": "object",
                 "properties": {"name": {"type": "string", "enum": [t["name"]]},
                                "parameters": t.get("parameters") or {"type": "object", "properties": {}}},
                 "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class ToolCallStream:
    """Splits a stream of text into content deltas and completed tool calls (Hermes format)."""

    def __init__(self) -> None:
        self.buffer = ""  # text not yet handed out
        self.in_call = False
        self.calls: list[ParsedCall] = []
        self.failed = False  # a block that did not parse: everything from there on is content

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ParsedCall]]:
        """Adds text; returns (content to send now, calls completed now)."""
        self.buffer += text
        content, done = "", []
        while True:
            if self.failed:
                content += self.buffer
                self.buffer = ""
                break
            if not self.in_call:
                at = self.buffer.find(OPEN)
                if at == -1:
                    keep = 0 if final else _partial_suffix(self.buffer, OPEN)
                    cut = len(self.buffer) - keep
                    content += self.buffer[:cut]
                    self.buffer = self.buffer[cut:]
                    break
                content += self.buffer[:at]
                self.buffer = self.buffer[at + len(OPEN):]
                self.in_call = True
            end = self.buffer.find(CLOSE)
            if end == -1 and not final:
                break
            body = self.buffer if end == -1 else self.buffer[:end]
            call = _call_of(body.strip())
            if call is None:
                self.failed = True
                self.buffer = OPEN + self.buffer
                continue
            done.append(call)
            self.calls.append(call)
            self.buffer = "" if end == -1 else self.buffer[end + len(CLOSE):]
            self.in_call = False
            if not self.buffer:
                break
        if self.calls and not self.failed:
            content = content if content.strip() else ""
        return content, done


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
