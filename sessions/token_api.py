"""The token-level routes of the session front: token ids in, token ids and logprobs out.

    POST /sessions/{id}/v1/generate   {"input_ids": [...], OpenAI sampling fields}
                                       -> {"output_ids", "logprobs", "finish_reason", "weight_versions", "usage"}
    POST /v1/tokenize                  {"messages": [...], "tools"?} | {"prompt": "text"}
    POST /sessions/{id}/v1/tokenize    (the same; for clients whose base_url is the session's)
                                       -> {"tokens": [...], "count"}

Agent harnesses that keep their own token ids (no re-tokenization between turns) call
`generate` with the whole prompt: it runs under the session's routing key and engine session
key (the same engine, the same KV reuse as the session's chat turns), with the same sampling
fields, limits and error shapes as chat completions. Its ids and logprobs are the engine's own,
unchanged. A token turn is not recorded in the session's message history: the harness holds
the ids it sent and got back (that is what it asked for token ids for).

`tokenize` of `messages` gives the prompt ids the first chat turn of a session with these
messages would send (the template with the generation prompt); of `prompt`, the plain encoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.core.errors import SessionError
from miles.rollout.tokens.tokenizer import Tokenizer
from miles.sessions.openai_api import check_tools, check_tree, parse_logprobs, parse_sampling

MAX_INPUT_IDS = 1 << 20  # far above any engine's max_seq_len; the engine names the real limit
# OpenAI chat fields the token route does not take: refused, not ignored (they would change the turn)
_NOT_ON_TOKENS = ("messages", "tools", "tool_choice", "stream", "n", "stop", "response_format")


@dataclass
class TokenGenerateBody:
    input_ids: list[int]
    sampling: dict[str, Any]


def _body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise SessionError(f"request body: expected a JSON object, got {type(body).__name__}")
    check_tree(body)
    return body


def check_ids(v: Any, where: str = "input_ids") -> list[int]:
    if not isinstance(v, list) or not v:
        raise SessionError(f"{where}: expected a non-empty list of token ids, got {type(v).__name__}")
    if len(v) > MAX_INPUT_IDS:
        raise SessionError(f"{where}: {len(v)} ids, more than {MAX_INPUT_IDS}")
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 1 << 31:
            raise SessionError(f"{where}[{i}]: expected a token id (an integer >= 0), got {x!r}")
    return v


def parse_generate_request(body: Any) -> TokenGenerateBody:
    """Validate a token-route body; raises SessionError naming the bad field."""
    body = _body(body)
    if "input_ids" not in body:
        raise SessionError("input_ids: missing (the token route takes the whole prompt as token ids)")
    given = [k for k in _NOT_ON_TOKENS if body.get(k) not in (None, False)]
    if given:
        raise SessionError(f"{given[0]}: not a field of the token route (use /v1/chat/completions for messages)")
    parse_logprobs(body)  # always returned here; the fields are checked as on the chat route
    return TokenGenerateBody(check_ids(body["input_ids"]), parse_sampling(body))


def generate_reply(out: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
    """The token route's answer from a `SessionService.generate` result."""
    return {"object": "generate", "output_ids": out["output_ids"], "logprobs": out["logprobs"],
            "finish_reason": out["finish_reason"], "weight_versions": out["versions"],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(out["output_ids"]),
                      "total_tokens": prompt_tokens + len(out["output_ids"]),
                      "prompt_tokens_details": {"cached_tokens": out["cached_tokens"]}}}


@dataclass
class TokenizeRequest:
    messages: list[Any] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt: str | None = None


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    body = _body(body)
    unknown = set(body) - {"messages", "tools", "prompt", "model"}
    if unknown:
        raise SessionError(f"unknown field(s) {sorted(unknown)}; valid: messages, model, prompt, tools")
    if ("messages" in body) == ("prompt" in body):
        raise SessionError("tokenize: give exactly one of messages (a chat) or prompt (a string)")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise SessionError(f"prompt: expected a string, got {type(body['prompt']).__name__}")
        return TokenizeRequest(prompt=body["prompt"])
    msgs = body["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise SessionError("messages: expected a non-empty list of chat messages")
    for i, m in enumerate(msgs):
        if isinstance(m, dict) and "role" in m and not isinstance(m["role"], str):
            raise SessionError(f"messages[{i}].role: expected a string, got {type(m['role']).__name__}")
    return TokenizeRequest(messages=msgs, tools=check_tools(body.get("tools")))


def content_logprobs(tok: Tokenizer, ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    """OpenAI `choices[0].logprobs` for the sampled ids: one entry per token, with its text, its
    UTF-8 bytes, the engine's logprob and (an extension) its id; no runners-up (top_logprobs 0)."""
    content = []
    for t, lp in zip(ids, logprobs, strict=True):
        text = tok.decode([t])
        content.append({"token": text, "logprob": float(lp), "bytes": list(text.encode("utf-8")),
                        "top_logprobs": [], "token_id": int(t)})
    return {"content": content}
