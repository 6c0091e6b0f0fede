"""Which admitted requests copy a prompt's KV instead of prefilling it (engine.share_prompts).

A GRPO group sends n requests with one prompt. Two ways to share it:

- admitted together: one leader per distinct token list prefills; its followers take the
  rows right after the leaders and copy the leader's KV rows, routing and last-token logits
  (`Stepper._prefill`), so each holds what its own prefill would have computed;
- admitted later, while a request with the same prompt is still running: the newcomer copies
  the first n-1 positions of that row (a running row only appends, so they are still the
  prompt's) and prefills its last prompt token itself, exactly like a session restore.
  Prompts that only begin alike (a shared system prompt, a group's first turn) share whole
  `BLOCK`-token blocks the same way: running prompts are indexed by the chained hashes of
  their blocks, and the newcomer copies the longest run of blocks it has in common with one
  (checked token by token) and prefills the rest.

A source must have computed its prompt under the current weight version (after a commit
the newcomer prefills afresh, as it would unshared) and must not hold a restored session
prefix (those may come from an older version).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles.engines.sequence import Sequence

BLOCK = 64  # tokens per shared block of a partly common prompt


def block_keys(tokens: list[int]) -> list[int]:
    """Chained hash of every whole block: key i stands for tokens[: BLOCK * (i + 1)]."""
    keys, h = [], 0
    for i in range(len(tokens) // BLOCK):
        h = hash((h, tuple(tokens[i * BLOCK : (i + 1) * BLOCK])))
        keys.append(h)
    return keys


class PromptShare:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._sources: dict[tuple[int, ...], list[Sequence]] = {}  # prompt -> running rows holding it
        self._blocks: dict[int, list[Sequence]] = {}  # block key -> running rows whose prompt has it
        self.tokens = 0  # prompt tokens copied instead of prefilled

    def order(self, taken: list[Sequence], restores: Callable[[Sequence], bool]) -> list[Sequence]:
        """Admission order for requests admitted together: one leader per distinct token list
        first (contiguous rows; they prefill), then each leader's followers in a run (marked by
        `share_from`). `restores(seq)`: it has a stored session, which it restores instead."""
        for seq in taken:
            # a request with images never shares: equal placeholder ids may stand for other pixels
            seq.prompt_key = tuple(seq.tokens) if self.enabled and seq.req.images is None else None
        if not self.enabled or len(taken) < 2:
            return taken
        leaders: dict[tuple[int, ...], Sequence] = {}
        followers: dict[int, list[Sequence]] = {}  # id(leader) -> its followers
        order: list[Sequence] = []
        for seq in taken:
            key = seq.prompt_key
            lead = None if restores(seq) or key is None else leaders.get(key)
            if lead is None:
                if not restores(seq) and key is not None:
                    leaders[key] = seq
                order.append(seq)
            else:
                seq.share_from = lead
                followers.setdefault(id(lead), []).append(seq)
                self.tokens += seq.n_prompt
        return order + [f for lead in order for f in followers.get(id(lead), [])]

    def source(self, seq: Sequence, version: int, routed: bool) -> tuple[Sequence, int] | None:
        """(a running row, n): its first n positions hold KV of seq's first n tokens under
        `version` (n = all but seq's last token for the same prompt, else whole common blocks),
        with routing when `routed`; None if no running row shares a block with seq."""
        if seq.prompt_key is None or len(seq.tokens) < 2:
            return None
        need = len(seq.tokens) - 1
        for src in self._sources.get(seq.prompt_key, []):
            if self._usable(src, version, routed, need):
                return src, need
        keys = block_keys(seq.tokens[:need])
        for i in range(len(keys) - 1, -1, -1):
            n = BLOCK * (i + 1)
            for src in self._blocks.get(keys[i], []):
                if self._usable(src, version, routed, n) and src.tokens[:n] == seq.tokens[:n]:
                    return src, n
        return None

    @staticmethod
    def _usable(src: Sequence, version: int, routed: bool, n: int) -> bool:
        # a row admitted in this same iteration has not been prefilled yet (kv_len still short)
        return src.prompt_version == version and src.kv_len >= n and (src.req.return_routed_experts or not routed)

    def register(self, seq: Sequence, version: int) -> None:
        """seq's prompt KV is (or, after this step's prefill, will be) its own, under `version`."""
        seq.prompt_version = version
        if seq.prompt_key is None or seq.cached > 0:
            return
        self._sources.setdefault(seq.prompt_key, []).append(seq)
        seq.block_keys = block_keys(seq.tokens)
        for k in seq.block_keys:
            self._blocks.setdefault(k, []).append(seq)

    def release(self, seq: Sequence) -> None:
        if seq.prompt_key is None:
            return
        _drop(self._sources, seq.prompt_key, seq)
        for k in seq.block_keys:
            _drop(self._blocks, k, seq)
        seq.block_keys = []

    def clear(self) -> None:
        self._sources.clear()
        self._blocks.clear()


def _drop(index: dict[Any, list[Sequence]], key: object, seq: Sequence) -> None:
    rows = index.get(key)
    if rows is not None and seq in rows:
        rows.remove(seq)
        if not rows:
            del index[key]
