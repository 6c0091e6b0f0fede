"""The megatron backend's sharded export: every rank sends its own tensor-/expert-parallel
slices, by the Megatron transfer plan (weightsync/shard_megatron.py), with no gather.

Plain code over the rank's parameter dict: it imports nothing of megatron, so a CPU test
drives it with weights cut the way the backend's loader cuts them (trainer/megatron/weights.py).
The backend passes its parameter list (trainer/megatron/layout.py `targets`) in, since the
trainer sits above this package.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import torch

from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.hf_io import hf_tensor_views
from miles.weightsync.shard_megatron import (
    MegatronParallel,
    MegatronShardExporter,
    MegatronTarget,
    param_key,
)
from miles.weightsync.shard_plan import ShardExport


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The full shape of every HF tensor of `spec` (from a meta-device build: no memory)."""
    with torch.device("meta"):
        model = CausalLM(spec)
    return {n: tuple(t.shape) for n, t in hf_tensor_views(model).items()}


class MegatronShards:
    """Rank `rank`'s sharded export. `names` are the megatron parameter names of the rank's
    model (Transformer Engine fuses some norms; `targets` picks the names that exist), `ep_rank`
    its expert-parallel rank. The transfer plan is built at the first export and kept.
    `targets(spec, names, ep_rank, ep)` lists the parameters (trainer/megatron/layout.py)."""

    def __init__(self, spec: ModelSpec, names: Collection[str], par: MegatronParallel, rank: int,
                 ep_rank: int, targets: Callable[[ModelSpec, Collection[str], int, int], Sequence[MegatronTarget]]
                 ) -> None:
        names = set(names)
        self.targets = targets(spec, names, ep_rank, par.ep)
        self.exporter = MegatronShardExporter(lambda e: targets(spec, names, e, par.ep), hf_shapes(spec),
                                              kv_heads=spec.num_kv_heads, num_layers=spec.num_layers,
                                              par=par, rank=rank)

    def export(self, params: Mapping[str, torch.Tensor], dtype: str) -> ShardExport:
        """This rank's send buffer in wire dtype `dtype` from its local parameters (by megatron name)."""
        local = {param_key(t): params[t.mcore].detach() for t in self.targets}
        return self.exporter.fill(local, dtype)
