"""Weight sync to 2 engine processes over zmq, broadcast (gloo) and disk_delta: bit-equal weights."""

from __future__ import annotations

import json

import pytest

from miles.actors.messages import Checksums, Health
from miles.core.schema.sync import SyncConfig
from miles.models.hf_io import checksums
from miles.weightsync.actor_wire import WeightSync

from .sync_helpers import client, named, perturb, start_engines, trainer_model

pytestmark = pytest.mark.timeout(90)


async def test_all_transports_reach_bit_equality(procs, tmp_path) -> None:
    directory = start_engines(procs, extra=["--hidden", "512", "--layers", "1"])
    host = await client(directory)
    model = trainer_model(hidden=512, layers=1)  # 2 MiB MLP weights: chunked by 1 MiB buckets
    engines = ["e0", "e1"]
    plan = [("zmq", 1), ("broadcast", 2), ("broadcast", 3), ("disk_delta", 4), ("disk_delta", 5)]
    syncs: dict[str, WeightSync] = {}
    try:
        for transport, version in plan:
            if transport not in syncs:
                cfg = SyncConfig(transport=transport, bucket_mib=1, verify_every=1, step_timeout_s=20,
                                 delta_dir=str(tmp_path / "deltas"))
                syncs[transport] = WeightSync(host, cfg, engines)
            perturb(model, seed=version)
            rep = await syncs[transport].push(version, named(model))
            assert rep.committed == engines and rep.dead == [] and rep.verified is True, (transport, rep)
            assert rep.transport == transport and rep.buckets >= 6
            want = checksums(model)
            for e in engines:
                assert await host.ref(e).ask(Checksums(), timeout=10) == want
                assert (await host.ref(e).ask(Health(), timeout=10)).version == version
        written = sorted(p.name for p in (tmp_path / "deltas").iterdir())
        assert written == ["weight_v4", "weight_v5"]  # atomic renames only; no tmp dirs left
        index = json.loads((tmp_path / "deltas" / "weight_v5" / "index.json").read_text())
        encodings = {e["encoding"].split("+")[0] for b in index["buckets"].values() for e in b}
        # v5 holds only v4's changed tensors: as XORs where they compress, else as their bytes
        assert index["base"] == 4 and "same" in encodings and encodings <= {"same", "xor", "full"}
    finally:
        for s in syncs.values():
            await s.close()
        await host.stop()
