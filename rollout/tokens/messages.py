"""Chat messages: normalisation, role-order validation and the message-match policies.

Incoming OpenAI-style messages are normalised into plain dicts (content
flattened to a string, tool-call arguments kept as given). Rendering uses a
copy whose arguments are parsed JSON objects, the form chat templates expect.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from miles.core.errors import SessionError
from miles.core.schema.rollout import MatchPolicy

Message = dict[str, Any]
ROLES = ("system", "user", "assistant", "tool")
_SIMPLE = frozenset(("user", "assistant", "system"))


# Where an image part stood in a message's content: Qwen2-VL / Qwen2.5-VL templates' own text
# for one image; the session store expands its <|image_pad|> (rollout/tokens/vl_placeholders.py).
IMAGE_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"


def _content(v: Any, where: str, images: list[Any] | None = None) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list):  # OpenAI content parts: text, and images when `images` collects them
        out = []
        for i, part in enumerate(v):
            if images is not None and isinstance(part, dict) and part.get("type") == "image":
                from miles.core.errors import ProtocolError
                from miles.core.images import ImageInput

                try:  # an ImageInput, or its JSON form (prompts stay JSON-able: the buffer dumps them)
                    images.append(ImageInput.coerce(part.get("image"), f"{where}.content[{i}].image"))
                except ProtocolError as exc:
                    raise SessionError(str(exc)) from None
                out.append(IMAGE_MARKER)
                continue
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise SessionError(f"{where}.content[{i}]: only {{'type': 'text', 'text': str}} parts are supported"
                                   + (" (and {'type': 'image', 'image': ImageInput} in user messages)"
                                      if images is not None else ""))
            out.append(part["text"])
        return "".join(out)
    raise SessionError(f"{where}.content: expected a string or a list of text parts, got {type(v).__name__}")


def _tool_calls(v: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(v, list):
        raise SessionError(f"{where}.tool_calls: expected a list, got {type(v).__name__}")
    out = []
    for i, c in enumerate(v):
        w = f"{where}.tool_calls[{i}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise SessionError(f"{w}: expected {{'function': {{'name': str, 'arguments': ...}}}}")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str | dict):
            raise SessionError(f"{w}.function.arguments: expected a JSON string or an object")
        out.append({"id": str(c.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def normalize(messages: Any, where: str = "messages") -> list[Message]:
    """Check shape and role order; return plain normalised message dicts."""
    if not isinstance(messages, list) or not messages:
        raise SessionError(f"{where}: expected a non-empty list of messages")
    out: list[Message] = []
    for i, m in enumerate(messages):
        # fast path: a plain user/assistant/system text message (the bulk of every history)
        if type(m) is dict and len(m) == 2 and type(m.get("content")) is str:
            role = m.get("role")
            if role in _SIMPLE and (role != "system" or i == 0):
                out.append({"role": role, "content": m["content"]})
                continue
        w = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise SessionError(f"{w}: expected an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise SessionError(f"{w}.role: {role!r} is not one of {', '.join(ROLES)}")
        images: list[Any] = []
        n: Message = {"role": role, "content": _content(m.get("content"), w, images if role == "user" else None)}
        if images:  # kept beside the text: the store expands their placeholders and carries them
            n["images"] = images
        if role == "system" and i != 0:
            raise SessionError(f"{w}: a system message is only allowed first")
        if role == "assistant":
            if m.get("reasoning_content"):
                n["reasoning_content"] = _content(m["reasoning_content"], w + ".reasoning_content")
            if m.get("tool_calls"):
                n["tool_calls"] = _tool_calls(m["tool_calls"], w)
        if role == "tool":
            prev = out[-1] if out else None
            if prev is None or not (prev["role"] == "tool" or prev.get("tool_calls")):
                raise SessionError(f"{w}: a tool message must follow an assistant message with tool_calls")
            if m.get("tool_call_id") is not None:
                n["tool_call_id"] = str(m["tool_call_id"])
        if m.get("name") is not None and role != "assistant":
            n["name"] = str(m["name"])
        out.append(n)
    return out


def check_ends_for_generation(messages: list[Message], where: str = "messages") -> None:
    last = messages[-1]["role"]
    if last not in ("user", "tool"):
        raise SessionError(f"{where}[{len(messages) - 1}]: the last message must be from user or tool "
                           f"to ask for a reply, got {last!r}")


def parse_args(args: str | dict[str, Any]) -> Any:
    if isinstance(args, dict):
        return args
    try:
        return json.loads(args)
    except json.JSONDecodeError:
        return args


def for_template(m: Message) -> Message:
    """The form chat templates expect: tool-call arguments as objects, not JSON strings."""
    if "tool_calls" not in m:
        return m
    r = dict(m)
    r["tool_calls"] = [
        {**c, "function": {"name": c["function"]["name"], "arguments": parse_args(c["function"]["arguments"])}}
        for c in m["tool_calls"]
    ]
    return r


def _calls(m: Message, parsed: bool) -> list[tuple[str, Any]]:
    out = []
    for c in m.get("tool_calls") or []:
        a = c["function"]["arguments"]
        if parsed:
            a = parse_args(a)
        elif isinstance(a, dict):
            a = json.dumps(a, sort_keys=True)
        out.append((c["function"]["name"], a))
    return out


def _strict(a: Message, b: Message) -> bool:
    return (a["role"] == b["role"] and a["content"] == b["content"]
            and a.get("reasoning_content", "") == b.get("reasoning_content", "")
            and _calls(a, False) == _calls(b, False))


def _loose(a: Message, b: Message) -> bool:
    return (a["role"] == b["role"] and a["content"] == b["content"]
            and a.get("reasoning_content", "") == b.get("reasoning_content", "")
            and _calls(a, True) == _calls(b, True))


def _role_content(a: Message, b: Message) -> bool:
    return a["role"] == b["role"] and a["content"] == b["content"]


def matcher(policy: MatchPolicy) -> Callable[[Message, Message], bool]:
    """`strict`: role, content, reasoning, tool calls (arguments as text); `loose_tool_call`:
    the same with arguments compared as parsed JSON; `role_content`: role and content only."""
    return {"strict": _strict, "loose_tool_call": _loose, "role_content": _role_content}[policy]
