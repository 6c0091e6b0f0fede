"""R3 in megatron's top-k router: recorded expert ids in, live gate weights out.

Each `TopKRouter` gets a `ReplaySlot` as its `router_replay`; megatron calls the slot's
`get_replay_topk(scores, topk, ...)` where it would take the top-k of the router scores.
With ids set, the slot returns those ids and the LIVE scores gathered at them (softmax
probabilities, or logits that megatron then softmaxes over the k picked experts when
`norm_topk_prob`), so gate weights keep their gradient; otherwise it takes the top-k.

The hook sits before token dispatch, on the tokens this rank routes, so it is the same
with expert parallelism (dispatch just moves tokens to the ids' owners). Under sequence
parallelism a router sees 1/tp of the tokens: the slot takes its rank's chunk.

The slots also keep the live scores (for `RouterProbe.overlap`, the drift metric) and
the ids actually used, reordered from megatron's [S, B] token order to packed order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from miles.core.errors import TrainerError
from miles.trainer.forward import RouterProbe


class ReplaySlot:
    """Duck-types megatron's `RouterReplay` for one router."""

    def __init__(self) -> None:
        self.layer_number: int | None = None  # megatron sets it
        self.ids: torch.Tensor | None = None  # [tokens, k] int64 in the router's token order
        self.keep = False
        self.scores: torch.Tensor | None = None
        self.used: torch.Tensor | None = None

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None,
        group_topk: int | None,
        compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ids is None:
            vals, idx = compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        else:
            idx = self._local(scores.shape[0], topk).to(scores.device)
            vals = scores.gather(1, idx)
        if self.keep:
            self.scores, self.used = scores.detach(), idx.detach()
        return vals, idx

    def _local(self, n: int, topk: int) -> torch.Tensor:
        ids = self.ids
        assert ids is not None
        if ids.shape[1] != topk:
            raise TrainerError(f"replayed routes have k={ids.shape[1]}, the router uses top-{topk}")
        if ids.shape[0] == n:
            return ids
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        if ids.shape[0] == n * tp:  # sequence parallel: this rank's contiguous token chunk
            r = ps.get_tensor_model_parallel_rank()
            return ids[r * n : (r + 1) * n]
        raise TrainerError(f"router sees {n} tokens but {ids.shape[0]} replayed routes were given")


def _routers(model: nn.Module) -> list[Any]:  # megatron TopKRouters (megatron-core is untyped)
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class MegatronRouting(RouterProbe):
    """The replay slots of one model, plus the `RouterProbe` interface the step uses."""

    def __init__(self, model: nn.Module) -> None:  # no super().__init__: no gate hooks here
        self.logits: list[torch.Tensor] = []
        self.active = False
        self.slots: list[ReplaySlot] = []
        for router in _routers(model):
            slot = ReplaySlot()
            slot.layer_number = getattr(router, "layer_number", None)
            router.router_replay = slot
            self.slots.append(slot)
        self.used: torch.Tensor | None = None

    def begin(self, padded_routes: torch.Tensor | None, keep: bool) -> None:
        """Before a forward: `padded_routes` [S*B, L, k] in megatron's token order, or None."""
        if padded_routes is not None and padded_routes.shape[1] != len(self.slots):
            raise TrainerError(
                f"routes cover {padded_routes.shape[1]} MoE layers, the model has {len(self.slots)}"
            )
        for j, slot in enumerate(self.slots):
            slot.ids = None if padded_routes is None else padded_routes[:, j].contiguous()
            slot.keep = keep or self.active
            slot.scores = slot.used = None

    def end(self, order: torch.Tensor, n_tokens: int) -> None:
        """After a forward: `order` [N] maps packed tokens into megatron's `n_tokens` token
        order (a sequence-parallel router saw only its chunk: nothing is kept then)."""
        seen = [s for s in self.slots if s.scores is not None and s.scores.shape[0] == n_tokens]
        if self.active:
            self.logits.extend(s.scores[order] for s in seen if s.scores is not None)
        used = [s.used[order] for s in seen if s.used is not None]
        self.used = torch.stack(used, dim=1) if used and len(used) == len(self.slots) else None
        for slot in self.slots:
            slot.ids = slot.scores = slot.used = None
            slot.keep = False

    def close(self) -> None:
        for slot in self.slots:
            slot.ids = None
