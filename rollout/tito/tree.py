"""The token checkpoints of one session: a tree of turns, each holding exact token ids.

A node is one committed turn: the messages it appended (spliced prompt text,
mask 0) followed by the assistant message the engine sampled (mask 1). Its
`rendered` text is the chat-template rendering of every message up to and
`covered` is the text its token ids stand for from the root: the prompt text the
engine got plus the decoded sampled text. A next turn whose rendering starts
with `covered` tokenizes only the rest; otherwise the store falls back to the
canonical rendering of the stored messages (see render.py). The root
holds no tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from miles.core.images import ImageInput
from miles.rollout.tokens.messages import Message
from miles.rollout.types import NOT_SAMPLED, Sample, Status

FINISH_TO_STATUS: dict[str, Status] = {
    "stop": "completed", "tool_calls": "completed", "length": "truncated",
    "abort": "aborted", "error": "failed",
}


@dataclass(eq=False)
class Node:
    id: int
    parent: Node | None
    messages: list[Message]  # appended messages, the last one the sampled assistant message
    n_spliced: int = 0  # leading tokens of `ids` that were tokenized, not sampled
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    experts: np.ndarray | None = None  # [len(ids), L, k] for this segment
    prompt_text: str = ""  # the rendered prompt of this turn (the engine's input, as text)
    sampled_text: str = ""  # the decoded sampled ids
    covered: str = ""  # prompt_text + sampled_text ("" when prompt_text was not rendered)
    gen_tail: str = ""  # the end of this turn's prompt text (the generation prompt)
    local_ctx: list[Message] = field(default_factory=list)  # fast path: system + this turn
    local_text: str | None = None  # rendering of local_ctx
    finish_reason: str = "stop"
    temperature: float = 1.0  # the sampling temperature of this turn's sampled ids
    children: list[Node] = field(default_factory=list)
    n_messages: int = 0  # messages from the root through this node
    n_tokens: int = 0  # tokens from the root through this node

    def path(self) -> list[Node]:
        """Nodes from the first turn down to this one (root excluded)."""
        out: list[Node] = []
        n: Node | None = self
        while n is not None and n.parent is not None:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    def token_ids(self) -> list[int]:
        ids: list[int] = []
        for n in self.path():
            ids.extend(n.ids)
        return ids

    def all_messages(self) -> list[Message]:
        msgs: list[Message] = []
        for n in self.path():
            msgs.extend(n.messages)
        return msgs


def leaves(root: Node) -> list[Node]:
    out: list[Node] = []
    stack = [root]
    while stack:
        n = stack.pop()
        if n.children:
            stack.extend(reversed(n.children))
        elif n is not root:
            out.append(n)
    return out


def trajectory(leaf: Node, metadata: dict[str, Any]) -> Sample:
    """The sample of the path root→leaf: the first turn's spliced tokens are the prompt."""
    path = leaf.path()
    first = path[0]
    prompt = first.ids[: first.n_spliced]
    resp: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    vers: list[int] = []
    experts: list[np.ndarray] | None = []
    for k, n in enumerate(path):
        spliced = n.n_spliced if k else 0
        start = 0 if k else first.n_spliced
        resp.extend(n.ids[start:])
        mask.extend([0] * spliced + [1] * (len(n.ids) - n.n_spliced))
        lps.extend([0.0] * spliced + n.logprobs)
        vers.extend([NOT_SAMPLED] * spliced + n.versions)
        if experts is not None:
            experts = experts + [n.experts] if n.experts is not None else None
    status: Status = FINISH_TO_STATUS.get(leaf.finish_reason, "completed")
    for n in path:
        s = FINISH_TO_STATUS.get(n.finish_reason, "completed")
        if s in ("aborted", "failed"):
            status = s
            break
    routed = np.concatenate(experts, axis=0) if experts else None
    return Sample(prompt_ids=prompt, response_ids=resp, loss_mask=mask, rollout_logprobs=lps,
                  versions=vers, routed_experts=routed, status=status, images=path_images(path),
                  temperature=leaf.temperature,  # one per trajectory (SessionStore.prepare_turn)
                  metadata={**metadata, "num_turns": len(path), "leaf": leaf.id,
                            "finish_reason": leaf.finish_reason})


def path_images(path: list[Node]) -> ImageInput | None:
    """Every image of the messages along `path`, in order (None when there is none)."""
    found = [img for n in path for m in n.messages for img in m.get("images", ())]
    return ImageInput.concat(found) if found else None
