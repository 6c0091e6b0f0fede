"""Where an admitted request's KV comes from before its prefill, and where it goes when it ends.

A session turn continues from the KV its previous turn left (`SessionKVStore`): restored up to
the longest common token prefix, all but the last token, so the prefill always computes the
last token's logits. With engine.session_kv_reuse = "same_version" a saved turn that older
weights wrote (in part) is recomputed instead, counted in `stale`. A request without a saved
session may copy a running row's prompt (engines/prompt_share.py). A finished turn of a known
session saves the KV it fed, with its routing record and the oldest version that wrote it.

Plain class, composed by `TorchEngine`; it runs under the engine's step lock, between steps.
"""

from __future__ import annotations

from miles.core.schema.engine import EngineConfig
from miles.engines.kv_cache import KVPool, SessionKV, SessionKVStore, common_prefix
from miles.engines.prompt_share import PromptShare
from miles.engines.sequence import Sequence
from miles.models.config import ModelSpec


class KVReuse:
    """Session KV restore/save and running-prompt copies for one engine's KV pool."""

    def __init__(self, cfg: EngineConfig, spec: ModelSpec, pool: KVPool, share: PromptShare) -> None:
        self.spec = spec
        self.pool = pool
        self.share = share
        self.sessions = SessionKVStore(cfg.kv_budget_tokens)
        self._reuse = cfg.session_kv_reuse
        self.stale = 0  # saved session KV not reused: older weights wrote it (session_kv_reuse)

    def has_session(self, seq: Sequence) -> bool:
        key = seq.req.session_key
        return key is not None and key in self.sessions

    def blocks_needed(self, seq: Sequence, leaders: set[tuple[int, ...]]) -> int:
        """KV blocks `seq` reserves if admitted now; a follower of a prompt already taken this
        round shares its full prompt blocks (the rule PromptShare.order applies), and `leaders`
        gains seq's prompt when it may lead."""
        key = tuple(seq.tokens)
        shares = self.share.enabled and not self.has_session(seq)
        need = self.pool.request_blocks(seq.req, shared=len(key) if shares and key in leaders else 0)
        if shares:
            leaders.add(key)
        return need

    def fill(self, seq: Sequence, version: int, routed: bool) -> None:
        """Before seq's prefill (its row open): restore its session, else copy a running prompt.
        `routed`: seq or one of its followers reports routing."""
        if seq.share_from is not None:  # a follower: the stepper copies its leader's rows
            return
        self._restore_session(seq, version)
        if seq.kv_len == 0:
            self._copy_running_prompt(seq, version, routed)

    def _copy_running_prompt(self, seq: Sequence, version: int, routed: bool) -> None:
        """A running row holds seq's prompt (a group's earlier sample: all but its last token
        is copied) or begins like it (whole common blocks are); seq's prefill feeds the rest
        (engines/prompt_share.py). `routed`: the source must have routing and seq keeps the prefix's."""
        found = self.share.source(seq, version, routed)
        if found is None:
            return
        src, n = found
        self.pool.share(src.row, seq.row, 1, n)
        seq.kv_len = n
        if routed:
            experts = src.routed_array(self.spec)
            assert experts is not None
            seq.routed_prefix = experts[:n]
        self.share.tokens += n

    def _restore_session(self, seq: Sequence, version: int) -> None:
        key = seq.req.session_key
        item = self.sessions.take(key) if key is not None else None
        if item is None:
            return
        if item.version != version and self._reuse == "same_version":
            self.stale += 1  # written (in part) by older weights: the turn recomputes it
            return
        n = min(common_prefix(item.ids, seq.tokens), len(seq.tokens) - 1)
        if seq.req.return_routed_experts and item.routed is None:
            n = 0  # the cached turn has no routing record; recompute to return it
        if n <= 0:
            return
        self.pool.restore(seq.row, item.k, item.v, n)
        seq.cached = seq.kv_len = n
        seq.kv_version = min(seq.kv_version, item.version)
        if item.routed is not None:
            seq.routed_prefix = item.routed[:n]

    def save(self, seq: Sequence, known_sessions: set[str]) -> None:
        """A finished row's fed KV, for its session's next turn (a session the engine still knows)."""
        key = seq.req.session_key
        if key is None or key not in known_sessions or seq.kv_len == 0:
            return
        k, v = self.pool.export(seq.row, seq.kv_len)
        routed = seq.routed_array(self.spec)
        self.sessions.put(key, SessionKV(ids=seq.tokens[: seq.kv_len], k=k, v=v, routed=routed,
                                         version=seq.kv_version))
