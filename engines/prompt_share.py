"""Which admitted requests copy a prompt's KV instead of prefilling it (engine.share_prompts).

A GRPO group sends n requests with one prompt. Two ways to share it:

- admitted together: one leader per distinct token list prefills; its followers take the
  rows right after the leaders and copy the leader's KV rows, routing and last-token logits
  (`Stepper._prefill`), so each holds what its own prefill would have computed;
- admitted later, while a request with the same prompt is still running: the newcomer copies
  the first n-1 positions of that row (a running row only appends, so they are still the
  prompt's) and prefills its last prompt token itself, exactly like a session restore.

A source must have computed its prompt under the current weight version (after a commit
the newcomer prefills afresh, as it would unshared) and must not hold a restored session
prefix (those may come from an older version).
"""

from __future__ import annotations

from collections.abc import Callable

from miles.engines.sequence import Sequence


class PromptShare:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._sources: dict[tuple[int, ...], list[Sequence]] = {}  # prompt -> running rows holding it
        self.tokens = 0  # prompt tokens copied instead of prefilled

    def order(self, taken: list[Sequence], restores: Callable[[Sequence], bool]) -> list[Sequence]:
        """Admission order for requests admitted together: one leader per distinct token list
        first (contiguous rows; they prefill), then each leader's followers in a run (marked by
        `share_from`). `restores(seq)`: it has a stored session, which it restores instead."""
        for seq in taken:
            seq.prompt_key = tuple(seq.tokens) if self.enabled else None
        if not self.enabled or len(taken) < 2:
            return taken
        leaders: dict[tuple[int, ...], Sequence] = {}
        followers: dict[int, list[Sequence]] = {}  # id(leader) -> its followers
        order: list[Sequence] = []
        for seq in taken:
            assert seq.prompt_key is not None
            lead = None if restores(seq) else leaders.get(seq.prompt_key)
            if lead is None:
                if not restores(seq):
                    leaders[seq.prompt_key] = seq
                order.append(seq)
            else:
                seq.share_from = lead
                followers.setdefault(id(lead), []).append(seq)
                self.tokens += seq.n_prompt
        return order + [f for lead in order for f in followers.get(id(lead), [])]

    def source(self, seq: Sequence, version: int, routed: bool) -> Sequence | None:
        """A running row whose first len(seq.tokens) - 1 positions hold seq's prompt KV under
        `version`, with its routing when `routed`; None if there is none."""
        if seq.prompt_key is None:
            return None
        need = len(seq.tokens) - 1
        for src in self._sources.get(seq.prompt_key, []):
            if src.prompt_version != version or src.kv_len < need or need < 1:
                continue
            if routed and not src.req.return_routed_experts:
                continue
            return src
        return None

    def register(self, seq: Sequence, version: int) -> None:
        """seq's prompt KV is (or, after this step's prefill, will be) its own, under `version`."""
        seq.prompt_version = version
        if seq.prompt_key is not None and seq.cached == 0:
            self._sources.setdefault(seq.prompt_key, []).append(seq)

    def release(self, seq: Sequence) -> None:
        rows = self._sources.get(seq.prompt_key) if seq.prompt_key is not None else None
        if rows is not None and seq in rows:
            rows.remove(seq)
            if not rows:
                del self._sources[seq.prompt_key]  # type: ignore[arg-type]

    def clear(self) -> None:
        self._sources.clear()
