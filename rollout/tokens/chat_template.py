"""Render Hugging Face style Jinja chat templates without importing transformers.

The environment mirrors the one transformers uses (sandboxed, trim_blocks,
lstrip_blocks, a `tojson` that keeps non-ASCII and honours `indent`,
`raise_exception`, `strftime_now`), so a model's own template renders the same
text here as under `tokenizer.apply_chat_template(..., tokenize=False)`.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from miles.core.errors import ConfigError, SessionError


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str, special: dict[str, str | None] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._tpl = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"chat template does not compile (line {exc.lineno}): {exc.message}") from exc
        self.source = source
        # globals flattened once: a shared context skips jinja's per-render ChainMap merge
        self._globals = dict(self._tpl.globals)
        self.special = dict(special or {})

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = False, **kwargs: Any) -> str:
        ctx = {**self._globals, "messages": messages, "tools": tools or None, "add_generation_prompt": add_generation_prompt,
               **self.special, **kwargs}
        try:
            # Template.render without its per-call wrapper; same output, less overhead per turn
            return "".join(self._tpl.root_render_func(self._tpl.new_context(ctx, shared=True)))
        except jinja2.TemplateError as exc:
            raise SessionError(f"chat template refused the conversation: {exc}") from exc
