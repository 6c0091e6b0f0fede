"""The token-in-token-out (TITO) session store: exact token ids for multi-turn chats.

Each turn tokenizes only the messages appended since the deepest stored
checkpoint that matches the request (render with the chat template, take the
text after the checkpoint's rendering, encode that suffix) and splices the ids
onto the checkpoint. The engine's sampled ids are stored as they are and never
re-tokenized, so an exported trajectory is exactly what the policy saw and
sampled. `linear` sessions reject a history that diverges from the stored one
(`Diverged`); `branching` sessions fork a child and export one trajectory per leaf.

Plain class: no sockets, no globals; every argument and result is a plain
value (turns.py); `sessions/service.py` serves it, in the rollout process. It composes the
template rendering (render.py), the tree match (match.py), the engine output check
(output_check.py), the assistant message parsing (assistant.py) and the session-less
one-turn path (one_turn.py).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from miles.core.errors import Diverged, SessionError
from miles.core.schema.rollout import (
    DEFAULTS,
    MatchPolicy,
    RenderMode,
    RolloutConfig,
    SessionPolicy,
    TemplateFallback,
)
from miles.rollout.tito.assistant import AssistantParser, openai_message
from miles.rollout.tito.match import deepest, diverged
from miles.rollout.tito.one_turn import OneTurnPath
from miles.rollout.tito.output_check import checked_output
from miles.rollout.tito.render import TurnRenderer
from miles.rollout.tito.temperature import logprob_temperature, turn_temperature
from miles.rollout.tito.tree import Node, leaves, trajectory
from miles.rollout.tito.turns import OneTurn, TurnPlan, TurnResult
from miles.rollout.tokens.messages import Message, check_ends_for_generation, matcher, normalize
from miles.rollout.tokens.tokenizer import Tokenizer
from miles.rollout.tokens.vl_placeholders import Placeholders, message_images, turn_images
from miles.rollout.types import Sample

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
        self.reasoning_tags = reasoning_tags
        self.max_sessions = max_sessions
        # the sampling every turn starts from (rollout.temperature/top_p/top_k); a turn's own
        # sampling overrides it, as the engine call merges them
        self.sampling = dict(sampling or {})
        self._sessions: dict[str, _Session] = {}
        # a VL policy's image placeholders (`enable_images`); None: image parts are refused
        self.placeholders: Placeholders | None = None
        self.renderer = TurnRenderer(tokenizer, template_fallback, verify_template, render_mode)
        self.assistant = AssistantParser(self.renderer.stop_texts, tool_parser, reasoning_tags)
        self._one = OneTurnPath(self.renderer, self.assistant, self._expand)

    @property
    def local_render(self) -> bool:
        """Whether a turn renders only the last turn + the new messages (render.py's fast path)."""
        return self.renderer.local

    @classmethod
    def from_config(cls, cfg: RolloutConfig, tokenizer: Tokenizer) -> SessionStore:
        tags = cfg.reasoning_tags
        return cls(tokenizer, cfg.session_policy, cfg.match_policy, cfg.tool_parser, cfg.template_fallback,
                   (tags[0], tags[1]) if tags else None, cfg.max_sessions, render_mode=cfg.render_mode,
                   sampling=cfg.sampling())

    def turn_temperature(self, sampling: dict[str, Any] | None = None) -> float:
        """The temperature a turn with these overrides of `self.sampling` samples at (temperature.py)."""
        return turn_temperature(self.sampling, sampling)

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
        node, pos = deepest(s.root, msgs, self._match)
        if self.policy == "linear" and node.children:
            raise diverged(s.id, node, msgs, pos, self._match)
        new = msgs[pos:]
        if not new:
            raise SessionError(f"session {s.id!r}: the request appends no message to the stored history")
        if node.parent is not None and logprob_temperature(node.temperature) != logprob_temperature(temperature):
            # one trajectory is trained under one temperature (its sample carries one)
            raise SessionError(f"temperature: session {s.id!r} sampled its earlier turns at temperature "
                               f"{node.temperature}, this turn asks for {temperature}; a trajectory keeps one "
                               "temperature (start a new session for another)")
        text, prompt_text, gen_tail = self.renderer.new_text(s.id, s.tools, node, msgs, pos)
        new_ids = self._expand(self.tok.encode(text), new)
        plan = TurnPlan(s.id, "plan-" + os.urandom(6).hex(), node.id, node.token_ids() + new_ids,
                        node.n_tokens, s.routing_key, turn_images(node.all_messages(), new))
        s.pending[plan.plan_id] = _Pending(plan, node, msgs, new, new_ids, prompt_text, gen_tail, temperature)
        return plan

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
        sampled, vers, experts = checked_output(pid, len(p.plan.prompt_ids), len(p.new_ids), sampled_ids,
                                                logprobs, routed_experts, versions, finish_reason)
        seg_len = len(p.new_ids) + len(sampled)
        text = self.tok.decode(sampled)
        message, oa_finish = self.assistant.message(text, finish_reason)
        parent = p.parent
        node = Node(id=s.next_node, parent=parent, messages=p.new + [message], n_spliced=len(p.new_ids),
                    ids=p.new_ids + sampled, logprobs=[float(x) for x in logprobs], versions=vers,
                    experts=experts, prompt_text=p.prompt_text, sampled_text=text, gen_tail=p.gen_tail,
                    covered=p.prompt_text + text if p.prompt_text else "", finish_reason=finish_reason,
                    temperature=p.temperature, n_messages=parent.n_messages + len(p.new) + 1, n_tokens=parent.n_tokens + seg_len)
        s.next_node += 1
        parent.children.append(node)
        del s.pending[pid]
        return TurnResult(openai_message(message), oa_finish, node.id, len(p.plan.prompt_ids), len(sampled))

    # -- one turn without a session ----------------------------------------------
    def prepare_one(self, messages: Any, tools: list[dict[str, Any]] | None = None,
                    metadata: dict[str, Any] | None = None, sampling: dict[str, Any] | None = None) -> OneTurn:
        """A one-turn trajectory's prompt ids, as the first turn of a new session would get them.

        `prepare_one` + `commit_one` give the sample that create, prepare_turn, commit_turn,
        export and close give for a session of one turn (without its `session_id`), storing
        nothing: what the rollout's default single-turn agent needs, at ~a third of the CPU.
        """
        return self._one.prepare(messages, tools, metadata, self.turn_temperature(sampling))

    def commit_one(self, turn: OneTurn, sampled_ids: list[int], logprobs: list[float],
                   routed_experts: np.ndarray | None = None, versions: int | list[int] = 0,
                   finish_reason: str = "stop") -> tuple[Sample, dict[str, Any], str]:
        """(the trajectory's sample, the assistant message in OpenAI form, its OpenAI finish_reason)."""
        return self._one.commit(turn, sampled_ids, logprobs, routed_experts, versions, finish_reason)

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
