"""Shared pieces of the weight-sync tests: engine processes, a client host, a tiny trainer model."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from miles.actors.messages import Checksums
from miles.actors.runtime.host import Host
from miles.core.schema.transport import TransportConfig
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.hf_io import hf_tensor_views
from miles.models.presets import tiny_config
from miles.models.registry import build_model

ENGINE_HOST = "tests/sync/procs/sync_engine_host.py"
VOCAB = 96


def spec(hidden: int = 64, layers: int = 2) -> ModelSpec:
    return ModelSpec.from_hf(tiny_config("qwen3", vocab_size=VOCAB, hidden_size=hidden,
                                         intermediate_size=2 * hidden, num_hidden_layers=layers))


def trainer_model(seed: int = 100, **kw: int) -> CausalLM:
    return build_model(spec(**kw), seed=seed)


def named(model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    yield from hf_tensor_views(model).items()


@torch.no_grad()
def perturb(model: CausalLM, seed: int, fraction: float = 0.5) -> None:
    """Change a subset of the weights (the rest stay bit-identical, as after a sparse update)."""
    g = torch.Generator().manual_seed(seed)
    for i, p in enumerate(model.parameters()):
        if (i * 7919 + seed) % 100 < fraction * 100:
            # drawn on the CPU generator (same numbers on every device), then moved to p
            p.add_((torch.randn(p.shape, generator=g) * 0.01).to(device=p.device, dtype=p.dtype))


def start_engines(procs, n: int = 2, seed: int = 0, extra: list[str] | None = None) -> str:
    """Process 0 runs the directory and engine e0; processes 1.. run e1..; returns the directory.
    All start at once: e1.. read the directory's address from e0's ready file once they have
    imported torch (side by side with e0's import, not after it)."""
    extra = extra or []
    first, first_ready = procs.start([ENGINE_HOST, "--run-directory", "--name", "e0", "--seed", str(seed), *extra])
    rest = [procs.start([ENGINE_HOST, "--directory-file", first_ready, "--name", f"e{i}", "--seed", str(seed + i),
                         *extra]) for i in range(1, n)]
    directory = procs.wait_ready(first, first_ready)
    for p, ready in rest:
        procs.wait_ready(p, ready)
    return directory


async def held(host: Host, engines: list[str]) -> list[dict[str, str]]:
    """Each engine's per-tensor checksums (what it serves now), in `engines` order."""
    return [await host.ref(e).ask(Checksums(), timeout=10) for e in engines]


async def client(directory: str) -> Host:
    h = Host(TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0), directory)
    await h.start()
    return h
