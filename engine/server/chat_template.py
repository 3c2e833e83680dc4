"""Chat templates from `chat_template.jinja` or `tokenizer_config.json`, rendered the way `transformers` renders them.

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
    """The model has no chat template, or the template refused the messages (or the request's
    chat_template_kwargs: `kwargs_at_fault`)."""

    def __init__(self, message: str, kwargs_at_fault: bool = False) -> None:
        super().__init__(message)
        self.kwargs_at_fault = kwargs_at_fault


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
        """The template as transformers' tokenizer loads it: `chat_template.jinja` first (what its `save_pretrained`
        writes since 4.50, llm-compressor's checkpoints included; it "takes priority over template entries in the
        tokenizer config", transformers/tokenization_utils_base.py), else tokenizer_config.json's `chat_template`.
        The BOS and EOS tokens come from tokenizer_config.json in both cases."""
        path = Path(folder) / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.exists() else {}
        raw = Path(folder) / "chat_template.jinja"
        template = raw.read_text(encoding="utf-8") if raw.exists() else config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not template:
            return None
        return cls(str(template), _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, extra: dict[str, Any] | None = None) -> str:
        """`extra`: vLLM's chat_template_kwargs, more variables for the template (e.g. enable_thinking); they cannot
        replace the ones set here."""
        variables: dict[str, Any] = {"tools": tools} if tools else {}
        clash = sorted(set(extra or {}) & {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs cannot set {', '.join(clash)}: the request's own fields "
                                    "set them", kwargs_at_fault=True)
        try:
            return self._template.render(**(extra or {}), **variables, messages=messages,
                                         add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                                         eos_token=self.eos_token)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from e
        except (TypeError, ValueError, ArithmeticError, LookupError) as e:  # a kwarg of the wrong type, say
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}",
                                    kwargs_at_fault=bool(extra)) from e
