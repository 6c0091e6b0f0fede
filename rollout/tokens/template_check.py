"""Append-only verifier for a tokenizer + chat template, and the named fallbacks.

TITO tokenizes each turn as a suffix appended to stored tokens. That equals
tokenizing the whole conversation only if the template is append-only: the
rendering of a conversation's first turns (and the generation prompt) is a
prefix of the rendering of the whole, and token boundaries do not merge across
turns. `check_template` renders canonical conversations (multi-turn, system
prompt, tool calls and tool results, reasoning content) and reports every place
where that fails. `miles check-template MODEL_DIR` prints its report.

Fallbacks a config may accept for a template that fails (`rollout.template_fallback`):
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.core.errors import NotAppendOnly
from miles.rollout.tokens.messages import IMAGE_MARKER, Message, for_template, normalize
from miles.rollout.tokens.tokenizer import Tokenizer

FALLBACKS: dict[str, str] = {
    "anchor_diff": (
        "tokenize appended messages by rendering them after a fixed reasoning-free anchor "
        "conversation (a short user message + the last stored assistant message without its "
        "reasoning) and taking the text difference. Accepts templates that rewrite earlier turns, "
        "e.g. drop earlier reasoning; the stored tokens - not a fresh render - then define what "
        "the policy saw, so training matches sampling but not the template's own multi-turn form."
    ),
}
__doc__ = (__doc__ or "") + "".join(f"\n- `{k}`: {v}" for k, v in FALLBACKS.items())

_CALC = {"type": "function", "function": {"name": "calc", "description": "evaluate arithmetic",
                                          "parameters": {"type": "object",
                                                         "properties": {"expr": {"type": "string"}}}}}


def _call(i: int, expr: str) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": "calc", "arguments": {"expr": expr}}}


CANONICAL: dict[str, tuple[list[Message], list[dict[str, Any]] | None]] = {
    "multi_turn": ([
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Bye"},
    ], None),
    "system_prompt": ([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "3*3?"}, {"role": "assistant", "content": "9"},
        {"role": "user", "content": "ok"},
    ], None),
    "tool_calls": ([
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "12*7?"},
        {"role": "assistant", "content": "", "tool_calls": [_call(0, "12*7")]},
        {"role": "tool", "tool_call_id": "call_0", "content": "84"},
        {"role": "assistant", "content": "84"},
        {"role": "user", "content": "and 1+1 and 2+2?"},
        {"role": "assistant", "content": "", "tool_calls": [_call(1, "1+1"), _call(2, "2+2")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
        {"role": "tool", "tool_call_id": "call_2", "content": "4"},
    ], [_CALC]),
    "reasoning": ([
        {"role": "user", "content": "5+6?"},
        {"role": "assistant", "reasoning_content": "5 plus 6 is 11", "content": "11"},
        {"role": "user", "content": "times 2?"},
        {"role": "assistant", "reasoning_content": "11 times 2 is 22", "content": "22"},
        {"role": "user", "content": "thanks"},
    ], None),
    # a VL conversation as the session store renders it: each image part is the template's marker
    # text, and a second image arrives in a later turn (rollout/tokens/vl_placeholders.py expands them)
    "images": ([
        {"role": "user", "content": f"{IMAGE_MARKER}What colour is the shape?"},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": f"And here?{IMAGE_MARKER}"},
    ], None),
}


@dataclass
class Finding:
    conversation: str
    turn: int  # index of the assistant message whose boundary fails
    kind: str  # prompt_not_prefix | history_not_prefix | token_boundary
    position: int  # character offset (text kinds) or token index (token_boundary)
    expected: str  # what the whole-conversation rendering/tokenization has there
    got: str  # what turn-by-turn rendering/tokenization has there

    def __str__(self) -> str:
        unit = "token" if self.kind == "token_boundary" else "char"
        return (f"{self.conversation} @ assistant message {self.turn}: {self.kind} at {unit} "
                f"{self.position}: whole {self.expected!r} vs turn-by-turn {self.got!r}")


@dataclass
class TemplateReport:
    findings: list[Finding] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def summary(self, limit: int | None = None) -> str:
        if self.ok:
            return f"append-only: OK ({len(self.checked)} conversations: {', '.join(self.checked)})"
        shown = self.findings if limit is None else self.findings[:limit]
        more = len(self.findings) - len(shown)
        return "\n".join([str(f) for f in shown] + ([f"... and {more} more"] if more > 0 else []))


def _diff_at(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _render(tok: Tokenizer, msgs: list[Message], tools: Any, gen: bool) -> str:
    return tok.apply_chat_template([for_template(m) for m in msgs], tools, gen)


def check_conversation(tok: Tokenizer, name: str, messages: list[Message],
                       tools: list[dict[str, Any]] | None = None) -> list[Finding]:
    msgs = normalize(messages, name)
    whole = _render(tok, msgs, tools, False)
    out: list[Finding] = []
    cuts: set[int] = set()
    for j, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        for kind, text in (("prompt_not_prefix", _render(tok, msgs[:j], tools, True)),
                           ("history_not_prefix", _render(tok, msgs[: j + 1], tools, False))):
            if whole.startswith(text):
                cuts.add(len(text))
            else:
                at = _diff_at(text, whole)
                out.append(Finding(name, j, kind, at, whole[at:at + 40], text[at:at + 40]))
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(whole)), len(whole)]
    pieces: list[int] = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        pieces.extend(tok.encode(whole[a:b]))
    ref = tok.encode(whole)
    if pieces != ref:
        at = _diff_at_list(ref, pieces)
        out.append(Finding(name, -1, "token_boundary", at, tok.decode(ref[at:at + 8]),
                           tok.decode(pieces[at:at + 8])))
    return out


def _diff_at_list(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def check_template(tok: Tokenizer,
                   conversations: dict[str, tuple[list[Message], list[dict[str, Any]] | None]] | None = None,
                   ) -> TemplateReport:
    """Render every canonical conversation and report where turn-by-turn differs from whole."""
    rep = TemplateReport()
    for name, (msgs, tools) in (conversations or CANONICAL).items():
        rep.findings.extend(check_conversation(tok, name, msgs, tools))
        rep.checked.append(name)
    return rep


def anchor_suffix(tok: Tokenizer, last_assistant: Message, new: list[Message],
                  tools: list[dict[str, Any]] | None) -> str:
    """The `anchor_diff` fallback: the text `new` adds after a reasoning-free anchor."""
    asst = {k: v for k, v in last_assistant.items() if k != "reasoning_content"}
    anchor: list[Message] = [{"role": "user", "content": "."}, asst]
    a = _render(tok, anchor, tools, False)
    b = _render(tok, anchor + new, tools, True)
    if not b.startswith(a):
        at = _diff_at(a, b)
        raise NotAppendOnly(f"anchor_diff fallback: the anchor's rendering is not a prefix at char {at} "
                            f"({a[at:at + 40]!r} vs {b[at:at + 40]!r}); this template cannot use TITO")
    return b[len(a):]


def check_local_render(tok: Tokenizer,
                       conversations: dict[str, tuple[list[Message], list[dict[str, Any]] | None]] | None = None,
                       ) -> TemplateReport:
    """Whether rendering only (system prompt + the last turn + new messages) yields the same new
    text as rendering the whole conversation, at every turn of the canonical conversations."""
    rep = TemplateReport()
    for name, (raw, tools) in (conversations or CANONICAL).items():
        msgs = normalize(raw, name)
        head = [msgs[0]] if msgs[0]["role"] == "system" else []
        bounds = [j for j, m in enumerate(msgs) if m["role"] == "assistant"]
        for prev, j in zip(bounds, [*bounds[1:], len(msgs)], strict=True):
            nxt = j if j < len(msgs) else len(msgs)
            start = max((b for b in bounds if b < prev), default=-1) + 1
            ctx = msgs[start:prev + 1]
            ctx_full = ctx if start == 0 else head + ctx
            new = msgs[prev + 1:nxt]
            if not new or new[-1]["role"] not in ("user", "tool"):
                continue
            whole_prev = _render(tok, msgs[:prev + 1], tools, False)
            whole_next = _render(tok, msgs[:nxt], tools, True)
            a = _render(tok, ctx_full, tools, False)
            b = _render(tok, ctx_full + new, tools, True)
            want = whole_next[len(whole_prev):] if whole_next.startswith(whole_prev) else None
            got = b[len(a):] if b.startswith(a) else None
            if want != got:
                rep.findings.append(Finding(name, prev, "not_local", 0, str(want)[:40], str(got)[:40]))
        rep.checked.append(name)
    return rep
