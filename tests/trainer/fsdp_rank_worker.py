"""One trainer rank for the multi-process FSDP test: argv = rank world port out_dir.

Trains one step on this rank's shard of a fixed global batch, then rank 0 writes the
metrics (JSON) and the updated weights (safetensors) to out_dir.
"""

from __future__ import annotations

import json
import os
import sys

from safetensors.torch import save_file

from miles.core.schema.trainer import TrainerConfig
from miles.launch.role import exit_now
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.trainer.batch import shard_batch
from miles.trainer.dist import leave_process_group
from miles.trainer.fsdp import FSDPTrainer
from miles.trainer.synthetic import engine_batch


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    spec = ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=96))
    batch = engine_batch(build_model(spec, seed=5), groups=4, group_size=2, seed=2)
    cfg = TrainerConfig()
    cfg.device = "cpu"
    cfg.world_size = world
    cfg.micro_batch_tokens = 24
    cfg.optim.lr = 1e-4
    cfg.optim.grad_clip = 0.0
    cfg.loss.aggregation = "seq_mean_token_mean"
    cfg.loss.kl_coef = 0.01
    trainer = FSDPTrainer(cfg, spec, rank, world, seed=7)
    metrics = trainer.train_step(shard_batch(batch, world)[rank])
    state = {k: v.contiguous().clone() for k, v in trainer.export_hf_state()}
    if rank == 0:
        save_file(state, os.path.join(out, "weights.safetensors"))
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump(metrics, f)
    # Leave without interpreter teardown: torch's background
    # threads can abort a 2-rank process at exit ("terminate called without an active
    # exception", 1 run in ~5 here) after every output above is written and closed.
    trainer.close()
    leave_process_group()
    exit_now(0)


if __name__ == "__main__":
    main()
