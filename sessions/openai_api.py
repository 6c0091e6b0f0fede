"""The OpenAI chat-completions schema as the session server speaks it.

Request bodies are checked field by field (a bad one raises `SessionError`
naming it); OpenAI sampling fields map to the engine's (`max_tokens` →
`max_new_tokens`; `top_k`, `stop_token_ids` accepted as extensions). Fields the
server cannot honour (n > 1, stop strings, forced tool choice, top_logprobs > 0)
are refused rather than silently ignored; other unknown fields are ignored, as
agents often send client-specific extras. `logprobs: true` returns, per sampled
token, the engine's own logprob (the one the session's sample carries). Replies
are `chat.completion` objects, or `chat.completion.chunk` lists for streaming.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field
from typing import Any

from miles.core.clock import new_id
from miles.core.errors import ProtocolError, SessionError
from miles.rollout.types import Sample

MAX_DEPTH = 32  # JSON nesting a chat body may have (tool arguments included)
# Below this a temperature divides logits into inf/NaN, which would fail every request of the
# engine batch it shares: refused up front (0 means greedy).
MIN_TEMPERATURE = 1e-3


def check_tree(body: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse nesting deeper than `max_depth` and strings that are not valid Unicode (lone surrogates).

    Iterative, so no input can exhaust the stack; called on every parsed request body.
    """
    stack: list[tuple[Any, str, int]] = [(body, "request body", 0)]
    while stack:
        v, where, depth = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise SessionError(f"{where}: not valid Unicode ({exc.reason} at {exc.start})") from None
            continue
        if isinstance(v, dict | list):
            if depth >= max_depth:
                raise SessionError(f"{where}: nested deeper than {max_depth} levels")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str):
                    stack.append((k, f"{where} (a key)", depth + 1))
                stack.append((x, f"{where}.{k}" if isinstance(v, dict) else f"{where}[{k}]", depth + 1))


def _check_messages(messages: Any) -> None:
    """Types the message normaliser relies on (a role must be hashable to be looked up)."""
    if not isinstance(messages, list):
        return  # normalize() names the problem
    for i, m in enumerate(messages):
        if isinstance(m, dict) and "role" in m and not isinstance(m["role"], str):
            raise SessionError(f"messages[{i}].role: expected a string, got {type(m['role']).__name__}")


@dataclass
class ChatRequest:
    messages: list[Any]
    tools: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    model: str = "policy"
    logprobs: bool = False  # return each sampled token's logprob (choices[0].logprobs.content)


def parse_logprobs(body: dict[str, Any]) -> bool:
    """OpenAI `logprobs` (bool) and `top_logprobs` (0 only: the engines return the sampled
    token's logprob, not the runners-up; refused rather than answered with an empty list)."""
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise SessionError(f"logprobs: expected true or false, got {lp!r}")
    top = _int(body, "top_logprobs", 0, 20)
    if top:
        raise SessionError(f"top_logprobs: only 0 is supported, got {top} (the engines return the sampled "
                           "token's logprob only)")
    return bool(lp)


def parse_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The engine sampling of an OpenAI-style body (chat and token routes alike)."""
    sampling: dict[str, Any] = {}
    for key, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        v = _number(body, key, lo, hi)
        if v is not None:
            sampling[key] = v
    t = sampling.get("temperature")
    if t is not None and 0.0 < t < MIN_TEMPERATURE:
        raise SessionError(f"temperature: expected 0 (greedy) or a number in [{MIN_TEMPERATURE}, 2.0], got {t!r}")
    max_tokens = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
    if max_tokens is not None:
        sampling["max_new_tokens"] = max_tokens
    for key, lo in (("top_k", -1), ("seed", 0)):
        iv = _int(body, key, lo)
        if iv is not None:
            sampling[key] = max(0, iv) if key == "top_k" else iv
    stops = body.get("stop_token_ids")
    if stops is not None:
        if not isinstance(stops, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 31 for x in stops):
            raise SessionError(f"stop_token_ids: expected a list of ints, got {stops!r}")
        sampling["stop_token_ids"] = stops
    return sampling


def _number(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise SessionError(f"{key}: expected a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def _int(body: dict[str, Any], key: str, lo: int, hi: int = (1 << 63) - 1) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise SessionError(f"{key}: expected an integer >= {lo} and <= {hi}, got {v!r}")
    return v


def check_tools(v: Any) -> list[dict[str, Any]] | None:
    """The OpenAI `tools` list, checked (a chat request's, or a session's at create)."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise SessionError(f"tools: expected a list, got {type(v).__name__}")
    for i, t in enumerate(v):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise SessionError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': str, ...}}}}")
    return v


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate an OpenAI chat-completions body; raises SessionError naming the bad field."""
    if not isinstance(body, dict):
        raise SessionError(f"request body: expected a JSON object, got {type(body).__name__}")
    if "messages" not in body:
        raise SessionError("messages: missing (a chat request needs the whole conversation)")
    check_tree(body)
    _check_messages(body["messages"])
    if body.get("n") not in (None, 1):
        raise SessionError(f"n: only 1 choice per request is supported, got {body['n']!r} (open n sessions)")
    if body.get("stop") not in (None, [], ""):
        raise SessionError("stop: stop strings are not supported (the engine stops on token ids; "
                           "use stop_token_ids)")
    logprobs = parse_logprobs(body)
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise SessionError(f"tool_choice: only 'auto' and 'none' are supported, got {choice!r}")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise SessionError(f"response_format: only {{'type': 'text'}} is supported, got {fmt!r}")
    sampling = parse_sampling(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise SessionError(f"stream: expected true or false, got {stream!r}")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise SessionError(f"stream_options: expected an object, got {opts!r}")
    model = body.get("model", "policy")
    if not isinstance(model, str):
        raise SessionError(f"model: expected a string, got {model!r}")
    tools = check_tools(body.get("tools"))
    return ChatRequest(body["messages"], tools if choice != "none" else None, sampling, stream,
                       bool(opts.get("include_usage")), model, logprobs)


def _usage(u: dict[str, Any]) -> dict[str, Any]:
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}


def completion(turn: dict[str, Any], model: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `chat.completion` object from a session turn (see SessionService.chat); `logprobs`:
    its `choices[0].logprobs` (sessions/token_api.py `content_logprobs`), when asked for."""
    return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": turn["message"], "logprobs": logprobs,
                                         "finish_reason": turn["finish_reason"]}],
            "usage": _usage(turn["usage"])}


def completion_chunks(turn: dict[str, Any], model: str, include_usage: bool,
                      logprobs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The same turn as `chat.completion.chunk`s: role, content, one per tool call, finish (, usage);
    the turn's logprobs, when asked for, ride on the finish chunk (the turn comes whole)."""
    cid, created = new_id("chatcmpl-"), int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        lp = logprobs if finish is not None else None
        c: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
        if include_usage:
            c["usage"] = None
        return c

    msg = turn["message"]
    out = [chunk({"role": "assistant", "content": ""})]
    if msg.get("reasoning_content"):
        out.append(chunk({"reasoning_content": msg["reasoning_content"]}))
    if msg.get("content"):
        out.append(chunk({"content": msg["content"]}))
    for i, call in enumerate(msg.get("tool_calls") or []):
        out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": dict(call["function"])}]}))
    out.append(chunk({}, turn["finish_reason"]))
    if include_usage:
        out.append({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [], "usage": _usage(turn["usage"])})
    return out


# ---------------------------------------------------------------- samples as JSON
def sample_to_json(s: Sample) -> dict[str, Any]:
    """`Sample.to_wire()` with routed experts as {dtype, shape, data: base64} (JSON-safe)."""
    d = s.to_wire(arrays_as_bytes=True)
    re = d["routed_experts"]
    if re is not None:
        d["routed_experts"] = {**re, "data": base64.b64encode(re["data"]).decode("ascii")}
    if "images" in d:  # a VL sample's pixels and grid, the same way
        d["images"] = {k: {**a, "data": base64.b64encode(a["data"]).decode("ascii")} for k, a in d["images"].items()}
    return d


def sample_from_json(d: Any, where: str = "sample") -> Sample:
    if isinstance(d, dict) and isinstance(d.get("routed_experts"), dict):
        re = d["routed_experts"]
        try:
            data = base64.b64decode(re.get("data", ""), validate=True)
        except (ValueError, TypeError) as exc:
            raise ProtocolError(f"{where}.routed_experts.data: not base64 ({exc})") from exc
        d = {**d, "routed_experts": {**re, "data": data}}
    if isinstance(d, dict) and isinstance(d.get("images"), dict):
        try:
            imgs = {k: {**a, "data": base64.b64decode(a.get("data", ""), validate=True)}
                    for k, a in d["images"].items()}
        except (ValueError, TypeError, AttributeError) as exc:
            raise ProtocolError(f"{where}.images: arrays must be {{dtype, shape, data: base64}} ({exc})") from exc
        d = {**d, "images": imgs}
    return Sample.from_wire(d, where)

