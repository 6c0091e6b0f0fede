"""Matching a request's messages against a session's stored tree: the deepest stored turn whose
messages begin the request (each compared with rollout.match_policy's matcher), and, for a
linear session that cannot extend there, the error saying where the request diverged."""

from __future__ import annotations

from collections.abc import Callable

from miles.core.errors import Diverged
from miles.rollout.tito.tree import Node
from miles.rollout.tokens.messages import Message

Match = Callable[[Message, Message], bool]


def deepest(root: Node, msgs: list[Message], match: Match) -> tuple[Node, int]:
    """The deepest stored node whose messages are a prefix of `msgs`, and that prefix length."""
    node, pos = root, 0
    while True:
        for child in node.children:
            k = len(child.messages)
            if pos + k <= len(msgs) and all(
                a == b or match(a, b) for a, b in zip(child.messages, msgs[pos:pos + k], strict=True)
            ):
                node, pos = child, pos + k
                break
        else:
            return node, pos


def diverged(sid: str, node: Node, msgs: list[Message], pos: int, match: Match) -> Diverged:
    """Why linear session `sid`'s request does not extend its stored chain at `node` (`pos` messages in)."""
    stored = node.children[0].all_messages()
    i = pos
    while i < min(len(stored), len(msgs)) and match(stored[i], msgs[i]):
        i += 1
    if i >= len(msgs):
        why = f"the request ends at message {len(msgs)} inside the stored history ({len(stored)} messages)"
    else:
        why = f"messages[{i}] ({msgs[i]['role']}) differs from the stored message {i}"
    return Diverged(f"session {sid!r} is linear and {why}; start a new session or use branching")
