"""Batch hand-out benchmark: the rollout's batch to W trainer ranks, before and after sharding.

A batch of 64 groups x 8 samples x 4k tokens (1k prompt + 3k response) with R3 routed
experts ([T, layers, top-k] uint8), handed to W data-parallel ranks through the real
codec and a real ZeroMQ loopback socket (zero-copy send, zero-copy receive):
- before: every rank asks for the whole batch (one dict per sample, per-token fields as
  Python lists, routed experts as frames), decodes all of it, builds every TrainSample and
  keeps `shard_batch(...)[rank]` (the code of actors/trainer.py before the change);
- after: the rollout cuts each rank's shard (rollout/handout.py), per-token arrays as a few
  columnar frames; the rank decodes only its shard into views (actors/trainer.py now).
Per W: rollout CPU time for all W replies, the slowest rank's receive + decode + build
time, bytes per rank, and the step's hand-out time (rollout + slowest rank; ranks decode in
parallel in a real run). Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np
import zmq

from miles.actors.trainer import samples_from_wire
from miles.rollout.handout import Handout
from miles.rollout.types import Group, Sample
from miles.trainer.batch import TrainBatch, TrainSample, shard_batch
from miles.transport import codec


def make_batch(groups: int, n: int, prompt: int, response: int, layers: int, topk: int) -> list[Group]:
    rng = np.random.default_rng(0)
    out = []
    for g in range(groups):
        p = rng.integers(0, 150_000, prompt).tolist()
        samples = []
        for i in range(n):
            lp = (-rng.random(response)).tolist()
            samples.append(Sample(
                prompt_ids=p, response_ids=rng.integers(0, 150_000, response).tolist(), loss_mask=[1] * response,
                rollout_logprobs=lp, versions=[g % 3] * response,
                routed_experts=rng.integers(0, 128, (prompt + response, layers, topk), dtype=np.uint8),
                reward=float(i % 2), index=i))
        out.append(Group(f"p{g}", samples, g, {"group_id": f"p{g}#1"}))
    return out


def old_samples_from_wire(groups: list[dict[str, Any]]) -> TrainBatch:
    """actors/trainer.py before: every sample of the whole batch, from per-sample dicts."""
    return TrainBatch([TrainSample(prompt_ids=s["prompt_ids"], response_ids=s["response_ids"],
                                   reward=float(s["reward"] or 0.0), group_index=gi, loss_mask=s["loss_mask"],
                                   rollout_logprobs=s["rollout_logprobs"], routed_experts=s.get("routed_experts"),
                                   versions=s["versions"]) for gi, g in enumerate(groups) for s in g["samples"]])


class Loopback:
    """A PUSH/PULL pair over tcp loopback: what a reply frame list costs to move."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(f"tcp://127.0.0.1:{port}")

    def move(self, frames: list[Any]) -> list[Any]:
        self.push.send_multipart(frames, copy=False)
        return [f.buffer for f in self.pull.recv_multipart(copy=False)]

    def close(self) -> None:
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()


def nbytes(frames: list[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


def run(groups: list[Group], world: int, sharded: bool, net: Loopback) -> dict[str, float]:
    t0 = time.perf_counter()
    if sharded:
        h = Handout()
        h.set(1, groups, {"m": 1.0})
        replies = [codec.encode(codec.REPLY, r, f"trainer-{r}", h.shard(r, world)) for r in range(world)]
    else:
        body = {"groups": [g.to_wire() for g in groups], "metrics": {"m": 1.0}}  # built once, cached
        replies = [codec.encode(codec.REPLY, r, f"trainer-{r}", body) for r in range(world)]
    rollout_s = time.perf_counter() - t0
    rank_s, sizes, samples = [], [], 0
    for r in range(world):
        t1 = time.perf_counter()
        body = codec.decode(net.move(replies[r])).body
        if sharded:
            batch = samples_from_wire(body["shard"])
        else:
            full = old_samples_from_wire(body["groups"])
            batch = shard_batch(full, world)[r] if world > 1 else full
        rank_s.append(time.perf_counter() - t1)
        sizes.append(nbytes(replies[r]))
        samples += len(batch.samples)
    assert samples == sum(len(g.samples) for g in groups)
    return {"rollout_s": rollout_s, "rank_s_max": max(rank_s), "rank_s_sum": sum(rank_s),
            "mb_per_rank": max(sizes) / 2**20, "handout_s": rollout_s + max(rank_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--response", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=24, help="MoE layers of the routed experts (R3)")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=2, help="best of")
    a = ap.parse_args()
    groups = make_batch(a.groups, a.samples, a.prompt, a.response, a.layers, a.topk)
    net = Loopback()
    rows = []
    try:
        for w in [int(x) for x in a.worlds.split(",")]:
            for sharded in (False, True):
                best = min((run(groups, w, sharded, net) for _ in range(a.repeats)), key=lambda m: m["handout_s"])
                rows.append({"world": w, "path": "after (sharded)" if sharded else "before (whole batch)", **best})
    finally:
        net.close()
    print(f"batch: {a.groups} groups x {a.samples} samples x {a.prompt}+{a.response} tokens, "
          f"R3 [T, {a.layers}, {a.topk}] uint8")
    print(f"{'W':>2} {'path':<22} {'rollout s':>10} {'slowest rank s':>15} {'MB/rank':>9} {'hand-out s':>11}")
    for r in rows:
        print(f"{r['world']:>2} {r['path']:<22} {r['rollout_s']:>10.3f} {r['rank_s_max']:>15.3f} "
              f"{r['mb_per_rank']:>9.1f} {r['handout_s']:>11.3f}")
    print(json.dumps({"bench": "batch_handout", "load_avg_1_5_15": os.getloadavg(), "groups": a.groups, "samples": a.samples, "prompt": a.prompt,
                      "response": a.response, "r3_layers": a.layers, "r3_topk": a.topk,
                      "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]}))


if __name__ == "__main__":
    main()
