"""Named parsers that turn model output text into OpenAI `tool_calls`.

`json_tags`: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
becomes one call; the text outside the tags is the message content. A block
that is not valid JSON is left in the content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.core.errors import ConfigError


@dataclass
class Parsed:
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


ToolParser = Callable[[str], Parsed]
_TAG = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _call_id() -> str:
    return "call_" + os.urandom(8).hex()


def parse_json_tags(text: str) -> Parsed:
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _TAG.finditer(text):
        kept.append(text[pos:m.start()])
        pos = m.end()
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            kept.append(m.group(0))
            continue
        args = obj.get("arguments", {})
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append({"id": _call_id(), "type": "function",
                      "function": {"name": obj["name"], "arguments": args_text}})
    kept.append(text[pos:])
    content = "".join(kept)
    return Parsed(content.strip() if calls else content, calls)


def parse_none(text: str) -> Parsed:
    return Parsed(text)


TOOL_PARSERS: dict[str, ToolParser] = {"json_tags": parse_json_tags, "none": parse_none}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ConfigError(f"unknown tool parser {name!r}; valid: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]


def register_tool_parser(name: str, parser: ToolParser) -> None:
    """Add a parser under `name` (e.g. from a plug-in module imported at start-up)."""
    TOOL_PARSERS[name] = parser


def split_reasoning(text: str, open_tag: str = "<think>", close_tag: str = "</think>") -> tuple[str, str]:
    """(reasoning, rest) when the text starts with a think block; else ("", text)."""
    s = text.lstrip()
    if s.startswith(open_tag):
        end = s.find(close_tag)
        if end >= 0:
            return s[len(open_tag):end].strip(), s[end + len(close_tag):].lstrip()
    return "", text
