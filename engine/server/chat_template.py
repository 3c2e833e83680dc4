"""Chat templates from `tokenizer_config.json`, rendered the way `transformers` renders them.

The engine image does not carry transformers, so the template runs in jinja2's immutable sandbox with the same
options and helpers (`raise_exception`, `tojson`, trim_blocks/lstrip_blocks) and the same variables
(`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and `tools` when the request has tools: a template
supports tools when it reads that variable).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template refused the messages."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # tokenizer_config.json may store an AddedToken as a dict
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatTemplate:
    def __init__(self, template: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        self._template = env.from_string(template)
        self.supports_tools = "tools" in meta.find_undeclared_variables(env.parse(template))
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_model_dir(cls, folder: str | Path) -> ChatTemplate | None:
        path = Path(folder) / "tokenizer_config.json"
        if not path.exists():
            return None
        config = json.loads(path.read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not template:
            return None
        return cls(str(template), _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from e
