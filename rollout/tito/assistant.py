"""The assistant message of a turn, from the text the engine sampled: the stop text cut off, the
reasoning split out (`reasoning_tags`), tool calls parsed (rollout.tool_parser), and its OpenAI
form with the OpenAI finish_reason (`tool_calls` when a stopped turn calls tools)."""

from __future__ import annotations

from typing import Any

from miles.rollout.tokens.messages import Message
from miles.rollout.tokens.tool_parser import get_tool_parser, split_reasoning


class AssistantParser:
    """Sampled text -> the assistant message, for one tokenizer's stop texts and one tool parser."""

    def __init__(self, stop_texts: list[str], tool_parser: str, reasoning_tags: tuple[str, str] | None) -> None:
        self.stop_texts = stop_texts
        self._parse_tools = get_tool_parser(tool_parser)
        self.reasoning_tags = reasoning_tags

    def message(self, text: str, finish: str) -> tuple[Message, str]:
        """(the assistant message as stored, the OpenAI finish_reason)."""
        body = text
        for st in self.stop_texts:
            if st and body.endswith(st):
                body = body[: -len(st)]
                break
        reasoning = ""
        if self.reasoning_tags is not None:
            reasoning, body = split_reasoning(body, *self.reasoning_tags)
        parsed = self._parse_tools(body)
        msg: Message = {"role": "assistant", "content": parsed.content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if parsed.tool_calls:
            msg["tool_calls"] = parsed.tool_calls
        oa = "tool_calls" if parsed.tool_calls and finish == "stop" else finish
        return msg, oa


def openai_message(m: Message) -> dict[str, Any]:
    """A stored assistant message in OpenAI form (copies: the stored one stays as it is)."""
    out: dict[str, Any] = {"role": "assistant", "content": m["content"]}
    if m.get("reasoning_content"):
        out["reasoning_content"] = m["reasoning_content"]
    if m.get("tool_calls"):
        out["tool_calls"] = [dict(c, function=dict(c["function"])) for c in m["tool_calls"]]
    return out
