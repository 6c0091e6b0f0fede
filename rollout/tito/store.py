"""The token-in-token-out (TITO) session store: exact token ids for multi-turn chats.

Each turn tokenizes only the messages appended since the deepest stored
checkpoint that matches the request (render with the chat template, take the
text after the checkpoint's rendering, encode that suffix) and splices the ids
onto the checkpoint. The engine's sampled ids are stored as they are and never
re-tokenized, so an exported trajectory is exactly what the policy saw and
sampled. `linear` sessions reject a history that diverges from the stored one
(`Diverged`); `branching` sessions fork a child and export one trajectory per leaf.

Plain class: no sockets, no globals; every argument and result is a plain
value; `sessions/service.py` serves it, in the rollout process.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from miles.core.errors import Diverged, NotAppendOnly, ProtocolError, SessionError
from miles.core.images import ImageInput
from miles.core.schema.rollout import (
    DEFAULTS,
    MatchPolicy,
    RenderMode,
    RolloutConfig,
    SessionPolicy,
    TemplateFallback,
    resolve_render_mode,
)
from miles.rollout.tito.tree import Node, leaves, trajectory
from miles.rollout.tokens.messages import (
    Message,
    check_ends_for_generation,
    for_template,
    matcher,
    normalize,
)
from miles.rollout.tokens.tokenizer import Tokenizer
from miles.rollout.tokens.tool_parser import get_tool_parser, split_reasoning
from miles.rollout.tokens.vl_placeholders import Placeholders, message_images, turn_images
from miles.rollout.types import Sample

FINISH_REASONS = ("stop", "length", "abort", "error")
_TAIL = 24  # characters of the generation prompt kept to locate sampled text in a rendering
# A session id is a path segment of its base URL (`/sessions/{id}/v1`): URL-unreserved characters
# only, starting with a letter or digit (no "." or ".." segments a client would normalise away).
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~-]{0,127}")


def check_session_id(sid: Any) -> str:
    """`sid` if it can name a session in a URL, else a SessionError saying why."""
    if not isinstance(sid, str) or not _SESSION_ID.fullmatch(sid):
        raise SessionError(f"session_id: {sid!r} cannot be a URL path segment; use 1-128 of A-Z a-z 0-9 . _ ~ -, "
                           "starting with a letter or digit (or leave it out for a generated one)")
    return sid


@dataclass
class TurnPlan:
    """What to send to the engine for one turn (plain values; `to_wire` for the wire)."""

    session_id: str
    plan_id: str
    parent: int
    prompt_ids: list[int]
    num_cached: int  # leading prompt ids already stored (the engine's prefix-cache candidate)
    routing_key: str = ""
    images: ImageInput | None = None  # every image of prompt_ids, in order (send with the ids)

    def to_wire(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "plan_id": self.plan_id, "parent": self.parent,
                "prompt_ids": self.prompt_ids, "num_cached": self.num_cached,
                "routing_key": self.routing_key}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> TurnPlan:
        try:
            return cls(str(d["session_id"]), str(d["plan_id"]), int(d["parent"]),
                       [int(x) for x in d["prompt_ids"]], int(d["num_cached"]),
                       str(d.get("routing_key", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"turn plan: malformed ({exc!r})") from exc


@dataclass
class TurnResult:
    """The committed turn: the assistant message in OpenAI form plus token accounting."""

    message: dict[str, Any]
    finish_reason: str  # OpenAI finish_reason: stop | length | tool_calls | abort | error
    node: int
    prompt_tokens: int
    completion_tokens: int

    def to_wire(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Pending:
    plan: TurnPlan
    parent: Node
    messages: list[Message]  # full history of the request
    new: list[Message]  # appended part
    new_ids: list[int]
    prompt_text: str  # "" when the fast path did not render the whole prompt
    gen_tail: str
    temperature: float = 1.0


@dataclass
class _Session:
    id: str
    routing_key: str
    tools: list[dict[str, Any]] | None
    tools_key: str | None = None
    root: Node = field(default_factory=lambda: Node(id=0, parent=None, messages=[]))
    next_node: int = 1
    pending: dict[str, _Pending] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


def _plain(m: Message) -> Message:
    """A message as JSON (images become their count: the pixels stay out of a summary)."""
    return m if "images" not in m else {**{k: v for k, v in m.items() if k != "images"}, "images": len(m["images"])}


def _tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _checked_output(pid: str, n_prompt: int, n_new: int, sampled_ids: list[int], logprobs: list[float],
                    routed_experts: np.ndarray | None, versions: int | list[int],
                    finish_reason: str) -> tuple[list[int], list[int], np.ndarray | None]:
    """The engine's output of one turn, checked: (sampled ids, per-token versions, the routed
    experts of this turn's segment: its `n_new` spliced prompt ids plus the sampled ones)."""
    sampled = [int(x) for x in sampled_ids]
    n = len(sampled)
    if len(logprobs) != n:
        raise SessionError(f"commit {pid}: {len(logprobs)} logprobs for {n} sampled tokens")
    vers = [int(versions)] * n if isinstance(versions, int) else [int(v) for v in versions]
    if len(vers) != n:
        raise SessionError(f"commit {pid}: {len(vers)} versions for {n} sampled tokens")
    if finish_reason not in FINISH_REASONS:
        raise SessionError(f"commit {pid}: finish_reason {finish_reason!r} not in {', '.join(FINISH_REASONS)}")
    seg_len = n_new + n
    experts = None
    if routed_experts is not None:
        ex = np.asarray(routed_experts)
        total = n_prompt + n
        if ex.ndim == 3 and n and 0 < ex.shape[0] and ex.shape[0] + 1 in (seg_len, total):
            # An engine that never feeds the last sampled token (SGLang; an aborted request of any
            # engine) has no row for it: repeat the last one. Only that token's own position reads
            # it in the replay, and no loss reads that position's output (engines/base.py).
            ex = np.concatenate([ex, ex[-1:]])
        if ex.ndim != 3 or ex.shape[0] not in (seg_len, total):
            raise SessionError(f"commit {pid}: routed_experts has shape {list(ex.shape)}; expected "
                               f"[{total} or {seg_len}, layers, k] (whole sequence or the new tokens, "
                               "or one row less)")
        experts = ex[-seg_len:] if seg_len else ex[:0]
    return sampled, vers, experts


@dataclass
class OneTurn:
    """The prompt of a one-turn trajectory that keeps no session (see `SessionStore.prepare_one`)."""

    prompt_ids: list[int]
    metadata: dict[str, Any]
    images: ImageInput | None = None  # every image of prompt_ids, in order
    temperature: float = 1.0  # what the turn samples at (`SessionStore.turn_temperature`)


def logprob_temperature(t: float) -> float:
    """The temperature a sample's logprobs are taken under: greedy (0) counts as 1 (models/logprobs.py)."""
    return t if t > 0 else 1.0


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v:
        raise SessionError(f"{what}: expected a number, got {v!r}")
    return float(v)


class SessionStore:
    """Sessions keyed by id; see the module doc. Template verification happens at construction."""

    # defaults are the rollout section's (core/schema/rollout.py)
    def __init__(self, tokenizer: Tokenizer, policy: SessionPolicy = DEFAULTS.session_policy,
                 match: MatchPolicy = DEFAULTS.match_policy, tool_parser: str = DEFAULTS.tool_parser,
                 template_fallback: TemplateFallback = DEFAULTS.template_fallback,
                 reasoning_tags: tuple[str, str] | None = ("<think>", "</think>"),
                 max_sessions: int = DEFAULTS.max_sessions, verify_template: bool = True,
                 render_mode: RenderMode = DEFAULTS.render_mode, sampling: dict[str, Any] | None = None) -> None:
        self.tok = tokenizer
        self.policy = policy
        self._match = matcher(match)
        self._parse_tools = get_tool_parser(tool_parser)
        self.reasoning_tags = reasoning_tags
        self.max_sessions = max_sessions
        # the sampling every turn starts from (rollout.temperature/top_p/top_k); a turn's own
        # sampling overrides it, as the engine call merges them
        self.sampling = dict(sampling or {})
        self._sessions: dict[str, _Session] = {}
        # a VL policy's image placeholders (`enable_images`); None: image parts are refused
        self.placeholders: Placeholders | None = None
        from miles.rollout.tokens.template_check import (
            FALLBACKS,
            check_local_render,
            check_template,
        )

        self.fallback = template_fallback
        if verify_template:
            report = check_template(tokenizer)
            if not report.ok and template_fallback == "none":
                raise NotAppendOnly("the chat template is not append-only, so suffix tokenization would "
                                    "not match the whole conversation; first problems:\n"
                                    + report.summary(3)
                                    + "\nset rollout.template_fallback to one of "
                                    + ", ".join(FALLBACKS) + " to accept a documented fallback")
        self._stop_texts = [self.tok.decode([i]) for i in self.tok.stop_token_ids]
        # local: render only the last turn + the new messages (verified equal on canonical chats)
        self.local_render = resolve_render_mode(render_mode, lambda: (
            verify_template and template_fallback == "none" and not check_local_render(tokenizer).findings)) == "local"

    @classmethod
    def from_config(cls, cfg: RolloutConfig, tokenizer: Tokenizer) -> SessionStore:
        tags = cfg.reasoning_tags
        return cls(tokenizer, cfg.session_policy, cfg.match_policy, cfg.tool_parser, cfg.template_fallback,
                   (tags[0], tags[1]) if tags else None, cfg.max_sessions, render_mode=cfg.render_mode,
                   sampling=cfg.sampling())

    def turn_temperature(self, sampling: dict[str, Any] | None = None) -> float:
        """The temperature a turn with these sampling overrides samples at (it travels with the
        sample to the trainer, which takes logprobs under it). Truncated sampling is refused:
        engine and trainer both take logprobs of the untruncated distribution (models/logprobs.py),
        so a top-p/top-k sample would train with importance weights of a policy it was not drawn from."""
        p = {**self.sampling, **(sampling or {})}
        top_p = _number(p.get("top_p", 1.0), "top_p")
        top_k = _number(p.get("top_k", 0), "top_k")
        if top_p != 1.0 or top_k > 0:
            what = f"top_p={p.get('top_p')}" if top_p != 1.0 else f"top_k={p.get('top_k')}"
            raise SessionError(f"{what}: truncated sampling is not trained on (the trainer's logprobs are of the "
                               "untruncated distribution, so its importance weights would be biased); use "
                               "top_p=1 and top_k=0 or -1")
        t = _number(p.get("temperature", 1.0), "temperature")
        if not 0.0 <= t < float("inf"):
            raise SessionError(f"temperature: expected a finite number >= 0, got {t!r}")
        return t

    def enable_images(self, image_token_id: int, merge: int) -> None:
        """Accept image parts in user messages, for a VL model with this placeholder id and
        spatial merge size (rollout/tokens/vl_placeholders.py)."""
        self.placeholders = Placeholders(image_token_id, merge)

    def _expand(self, ids: list[int], new: list[Message]) -> list[int]:
        if self.placeholders is None:
            if message_images(new):
                raise SessionError("a message holds an image but the policy is not a vision-language model")
            return ids
        return self.placeholders.expand(ids, new)

    # -- lifecycle -------------------------------------------------------------
    def create(self, session_id: str | None = None, routing_key: str | None = None,
               tools: list[dict[str, Any]] | None = None, metadata: dict[str, Any] | None = None) -> str:
        sid = check_session_id(session_id) if session_id else "sess-" + os.urandom(8).hex()
        if sid in self._sessions:
            raise SessionError(f"session {sid!r} already exists")
        if len(self._sessions) >= self.max_sessions:
            raise SessionError(f"session store is full ({self.max_sessions} sessions); close finished ones")
        s = _Session(sid, routing_key or sid, tools, metadata=dict(metadata or {}))
        if tools is not None:
            s.tools_key = _tools_key(tools)
        self._sessions[sid] = s
        return sid

    def close(self, session_id: str) -> None:
        self._get(session_id)
        del self._sessions[session_id]

    def routing_key(self, session_id: str) -> str:
        """The session's routing key (its engine); for the front's token route."""
        return self._get(session_id).routing_key

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def _get(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise SessionError(f"unknown session {session_id!r}")
        return s

    # -- turns -----------------------------------------------------------------
    def _render(self, s: _Session, msgs: list[Message], gen: bool) -> str:
        return self.tok.apply_chat_template([for_template(m) for m in msgs], s.tools, gen)

    def _deepest(self, s: _Session, msgs: list[Message]) -> tuple[Node, int]:
        """The deepest stored node whose messages are a prefix of `msgs`, and that prefix length."""
        node, pos = s.root, 0
        while True:
            for child in node.children:
                k = len(child.messages)
                if pos + k <= len(msgs) and all(
                    a == b or self._match(a, b) for a, b in zip(child.messages, msgs[pos:pos + k], strict=True)
                ):
                    node, pos = child, pos + k
                    break
            else:
                return node, pos

    def _diverged(self, s: _Session, node: Node, msgs: list[Message], pos: int) -> Diverged:
        stored = node.children[0].all_messages()
        i = pos
        while i < min(len(stored), len(msgs)) and self._match(stored[i], msgs[i]):
            i += 1
        if i >= len(msgs):
            why = f"the request ends at message {len(msgs)} inside the stored history ({len(stored)} messages)"
        else:
            why = f"messages[{i}] ({msgs[i]['role']}) differs from the stored message {i}"
        return Diverged(f"session {s.id!r} is linear and {why}; start a new session or use branching")

    def prepare_turn(self, session_id: str, messages: Any, tools: list[dict[str, Any]] | None = None,
                     sampling: dict[str, Any] | None = None) -> TurnPlan:
        """Match the request to the deepest checkpoint and tokenize only the appended messages.
        `sampling`: the turn's overrides of `self.sampling` (its temperature is recorded)."""
        s = self._get(session_id)
        temperature = self.turn_temperature(sampling)
        msgs = normalize(messages)
        check_ends_for_generation(msgs)
        if s.tools_key is None:
            s.tools, s.tools_key = tools, _tools_key(tools)
        elif tools is not None and _tools_key(tools) != s.tools_key:
            raise Diverged(f"session {s.id!r}: the tools differ from the ones the session started with")
        if self.policy == "linear" and s.pending:
            raise SessionError(f"session {s.id!r} is linear and a turn is already in flight")
        node, pos = self._deepest(s, msgs)
        if self.policy == "linear" and node.children:
            raise self._diverged(s, node, msgs, pos)
        new = msgs[pos:]
        if not new:
            raise SessionError(f"session {s.id!r}: the request appends no message to the stored history")
        if node.parent is not None and logprob_temperature(node.temperature) != logprob_temperature(temperature):
            # one trajectory is trained under one temperature (its sample carries one)
            raise SessionError(f"temperature: session {s.id!r} sampled its earlier turns at temperature "
                               f"{node.temperature}, this turn asks for {temperature}; a trajectory keeps one "
                               "temperature (start a new session for another)")
        text, prompt_text, gen_tail = self._new_text(s, node, msgs, pos)
        new_ids = self._expand(self.tok.encode(text), new)
        plan = TurnPlan(s.id, "plan-" + os.urandom(6).hex(), node.id, node.token_ids() + new_ids,
                        node.n_tokens, s.routing_key, turn_images(node.all_messages(), new))
        s.pending[plan.plan_id] = _Pending(plan, node, msgs, new, new_ids, prompt_text, gen_tail, temperature)
        return plan

    def _prompt_text(self, s: _Session, node: Node) -> str:
        """The rendered prompt of `node`'s turn (kept from prepare, or rendered when not kept)."""
        if not node.prompt_text:
            node.prompt_text = self._render(s, node.all_messages()[:-1], True)
        return node.prompt_text

    def _local_new_text(self, s: _Session, node: Node, new: list[Message]) -> tuple[str, str] | None:
        """Fast path for templates verified local: render only the last turn plus the new messages."""
        if not node.sampled_text:
            return None
        if node.local_text is None:
            first = node.path()[0].messages[0]
            head = [first] if first["role"] == "system" and node.messages[0] is not first else []
            node.local_ctx = head + node.messages
            node.local_text = self._render(s, node.local_ctx, False)
        a = node.local_text
        b = self._render(s, node.local_ctx + new, True)
        idx = a.rfind(node.sampled_text)
        if not b.startswith(a) or idx < 0 or not a[:idx].endswith(node.gen_tail):
            return None
        return a[idx + len(node.sampled_text):] + b[len(a):], b[-_TAIL:]

    def _new_text(self, s: _Session, node: Node, msgs: list[Message], pos: int) -> tuple[str, str, str]:
        """(text to tokenize, the full prompt text if rendered, the generation prompt's tail)."""
        if node.parent is None:
            full = self._render(s, msgs, True)
            return full, full, full[-_TAIL:]
        if self.local_render:
            got = self._local_new_text(s, node, msgs[pos:])
            if got is not None:
                return got[0], "", got[1]
        full = self._render(s, msgs, True)
        covered = node.covered or self._prompt_text(s, node) + node.sampled_text
        if full.startswith(covered):  # one render, nothing re-tokenized
            return full[len(covered):], full, full[-_TAIL:]
        # The template writes the stored turn differently from how the model sampled it
        # (tool-call JSON spacing, a truncated turn, a leniently matched message): close the
        # stored turn with the template's own end-of-turn text, then append the new messages.
        rendered = self._render(s, node.all_messages(), False)
        gap = self._gap(rendered, self._prompt_text(s, node), node.sampled_text, node.ids[node.n_spliced:])
        if full.startswith(rendered):
            return gap + full[len(rendered):], full, full[-_TAIL:]
        prefix = self._render(s, msgs[:pos], False)
        if full.startswith(prefix):
            return gap + full[len(prefix):], full, full[-_TAIL:]
        if self.fallback == "anchor_diff":
            from miles.rollout.tokens.template_check import anchor_suffix

            return gap + anchor_suffix(self.tok, node.messages[-1], msgs[pos:], s.tools), full, full[-_TAIL:]
        at = _first_difference(prefix, full)
        raise NotAppendOnly(f"session {s.id!r}: rendering the stored messages is not a prefix of rendering "
                            f"the request (first difference at character {at}: stored "
                            f"{prefix[at:at + 40]!r} vs request {full[at:at + 40]!r})")

    def cancel_turn(self, session_id: str, plan: TurnPlan | str) -> None:
        """Forget a prepared turn the engine did not serve (the session stays as it was)."""
        s = self._get(session_id)
        pid = plan if isinstance(plan, str) else plan.plan_id
        if s.pending.pop(pid, None) is None:
            raise SessionError(f"session {s.id!r}: no turn {pid!r} in flight")

    def commit_turn(self, session_id: str, plan: TurnPlan | str, sampled_ids: list[int],
                    logprobs: list[float], routed_experts: np.ndarray | None = None,
                    versions: int | list[int] = 0, finish_reason: str = "stop") -> TurnResult:
        """Store the engine's sampled ids as they are; return the assistant message."""
        s = self._get(session_id)
        pid = plan if isinstance(plan, str) else plan.plan_id
        p = s.pending.get(pid)
        if p is None:
            raise SessionError(f"session {s.id!r}: no turn {pid!r} in flight (committed twice or cancelled?)")
        sampled, vers, experts = _checked_output(pid, len(p.plan.prompt_ids), len(p.new_ids), sampled_ids,
                                                 logprobs, routed_experts, versions, finish_reason)
        seg_len = len(p.new_ids) + len(sampled)
        text = self.tok.decode(sampled)
        message, oa_finish = self._assistant_message(text, sampled, finish_reason)
        parent = p.parent
        node = Node(id=s.next_node, parent=parent, messages=p.new + [message], n_spliced=len(p.new_ids),
                    ids=p.new_ids + sampled, logprobs=[float(x) for x in logprobs], versions=vers,
                    experts=experts, prompt_text=p.prompt_text, sampled_text=text, gen_tail=p.gen_tail,
                    covered=p.prompt_text + text if p.prompt_text else "", finish_reason=finish_reason,
                    temperature=p.temperature, n_messages=parent.n_messages + len(p.new) + 1, n_tokens=parent.n_tokens + seg_len)
        s.next_node += 1
        parent.children.append(node)
        del s.pending[pid]
        return TurnResult(self._openai_message(message), oa_finish, node.id, len(p.plan.prompt_ids), len(sampled))

    def _assistant_message(self, text: str, sampled: list[int], finish: str) -> tuple[Message, str]:
        body = text
        for st in self._stop_texts:
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

    @staticmethod
    def _openai_message(m: Message) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": m["content"]}
        if m.get("reasoning_content"):
            out["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_calls"):
            out["tool_calls"] = [dict(c, function=dict(c["function"])) for c in m["tool_calls"]]
        return out

    def _gap(self, rendered: str, prompt_text: str, sampled_text: str, sampled: list[int]) -> str:
        """Template text after the sampled tokens that belongs to this turn (e.g. '\\n')."""
        if rendered.startswith(prompt_text):
            block = rendered[len(prompt_text):]
            if block.startswith(sampled_text):
                return block[len(sampled_text):]
        else:
            block = rendered
        # The model's own wording differs from the template's (tool-call JSON spacing,
        # truncation): close the turn after the template's end-of-turn token.
        ended = bool(sampled) and sampled[-1] in self.tok.stop_token_ids
        for st in self._stop_texts:
            i = block.rfind(st) if st else -1
            if i >= 0:
                tail = block[i + len(st):]
                return tail if ended else st + tail
        return ""

    # -- one turn without a session ----------------------------------------------
    def prepare_one(self, messages: Any, tools: list[dict[str, Any]] | None = None,
                    metadata: dict[str, Any] | None = None, sampling: dict[str, Any] | None = None) -> OneTurn:
        """A one-turn trajectory's prompt ids, as the first turn of a new session would get them.

        `prepare_one` + `commit_one` give the sample that create, prepare_turn, commit_turn,
        export and close give for a session of one turn (without its `session_id`), storing
        nothing: what the rollout's default single-turn agent needs, at ~a third of the CPU.
        """
        temperature = self.turn_temperature(sampling)
        msgs = normalize(messages)
        check_ends_for_generation(msgs)
        text = self.tok.apply_chat_template([for_template(m) for m in msgs], tools, True)
        return OneTurn(self._expand(self.tok.encode(text), msgs), dict(metadata or {}), turn_images([], msgs),
                       temperature)

    def commit_one(self, turn: OneTurn, sampled_ids: list[int], logprobs: list[float],
                   routed_experts: np.ndarray | None = None, versions: int | list[int] = 0,
                   finish_reason: str = "stop") -> tuple[Sample, dict[str, Any], str]:
        """(the trajectory's sample, the assistant message in OpenAI form, its OpenAI finish_reason)."""
        n_prompt = len(turn.prompt_ids)
        sampled, vers, experts = _checked_output("one turn", n_prompt, n_prompt, sampled_ids, logprobs,
                                                 routed_experts, versions, finish_reason)
        message, oa_finish = self._assistant_message(self.tok.decode(sampled), sampled, finish_reason)
        node = Node(id=1, parent=Node(id=0, parent=None, messages=[]), messages=[message], n_spliced=n_prompt,
                    ids=turn.prompt_ids + sampled, logprobs=[float(x) for x in logprobs], versions=vers,
                    experts=experts, finish_reason=finish_reason, temperature=turn.temperature)
        sample = trajectory(node, turn.metadata)
        sample.images = turn.images
        return sample, self._openai_message(message), oa_finish

    # -- export ----------------------------------------------------------------
    def export(self, session_id: str) -> list[Sample]:
        """One `Sample` per trajectory: the single chain (linear) or each leaf (branching)."""
        s = self._get(session_id)
        meta = {"session_id": s.id, **s.metadata}
        return [trajectory(leaf, meta) for leaf in leaves(s.root)]

    def info(self, session_id: str) -> dict[str, Any]:
        """A plain summary for `GET /sessions/{id}`."""
        s = self._get(session_id)
        ls = leaves(s.root)
        return {"session_id": s.id, "routing_key": s.routing_key, "policy": self.policy,
                "turns": s.next_node - 1, "in_flight": len(s.pending), "trajectories": len(ls),
                "tokens": [leaf.n_tokens for leaf in ls],
                "messages": [[_plain(m) for m in leaf.all_messages()] for leaf in ls]}
