"""The VLM recipe on CPU: examples/vlm*.toml end to end, then the held-out reward before and after RL.

Runs `miles train` on the config (the supervised warm-up with images, then RL, all processes
of a launched run), then evaluates the warm-up checkpoint and the run's final_hf on the same
held-out prompts (another env seed than training's) through the torch engine and the session
store, exactly as the rollout does: the sampled reward (temperature 1, seeded) and the greedy
one. Reports the RL wall time, the training reward curve's first and last quarter, the
held-out rise and the image-token mismatches the trainer counted (must be 0 every step).

    python bench/vlm_cpu.py [--config examples/vlm.toml] [--steps N] [--heldout 256]

Last line: one JSON object. Results: bench/results/<name>.txt / .json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from launched import REPO, train  # bench/ is on sys.path when this file runs as a script

OUT = REPO / "bench" / "results"


async def heldout_reward(ckpt: str, tok_dir: str, env_args: dict[str, Any], n: int, temperature: float,
                         env_path: str) -> float:
    from miles.core.hooks import resolve_hook
    from miles.core.schema.engine import EngineConfig
    from miles.engines.base import GenerateRequest, SamplingParams
    from miles.engines.torch_engine import TorchEngine
    from miles.models.hf_io import load_model
    from miles.rollout.layers import GenerateContext, default_generate, load_layer
    from miles.rollout.tito.client import EngineOutput, LocalSessionClient
    from miles.rollout.tito.store import SessionStore
    from miles.rollout.tokens.tokenizer import load_tokenizer
    from miles.rollout.tokens.vl_placeholders import placeholders_from_checkpoint

    tok = load_tokenizer(tok_dir)
    env = resolve_hook(env_path, "rollout.env")(**{**env_args, "seed": 12345})  # held out: another seed
    store = SessionStore(tok)
    store.placeholders = placeholders_from_checkpoint(ckpt)
    engine = TorchEngine(load_model(ckpt), EngineConfig(max_batch_size=128, max_seq_len=256, kv_budget_tokens=0))
    seed = iter(range(10**9))

    async def engine_fn(ids: list[int], sampling: dict[str, Any], images: Any = None) -> EngineOutput:
        sp = SamplingParams(temperature=temperature, max_new_tokens=8, stop_token_ids=tok.stop_token_ids,
                            seed=next(seed))
        r = await engine.generate(GenerateRequest(ids, sp, images=images))
        return EngineOutput(r.output_ids, r.logprobs, r.finish_reason, r.versions)

    agent = load_layer("agent", env.agent)
    client = LocalSessionClient(store, engine_fn)

    async def one(i: int) -> float:
        prompt = env.prompts.item(i)
        [s] = await default_generate(GenerateContext(client, prompt, agent))
        return float(env.reward(prompt, s))

    try:
        rewards = await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await engine.close()
    return sum(rewards) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "vlm.toml"))
    ap.add_argument("--steps", type=int, default=0, help="RL steps (0 = the config's)")
    ap.add_argument("--heldout", type=int, default=256, help="held-out prompts evaluated")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--name", default="", help="result file name (default: vlm_cpu or vlm_multiturn_cpu)")
    a = ap.parse_args()
    from miles.core.config import load_config
    from miles.core.schema import MilesConfig

    run_dir = tempfile.mkdtemp(prefix="vlm_cpu_")
    sets = [f"run.dir={run_dir}", *a.set] + ([f"run.steps={a.steps}"] if a.steps else [])
    rows, wall = train(a.config, sets)
    cfg = load_config(MilesConfig, a.config, sets)
    resolved = json.loads((Path(run_dir) / "config.resolved.json").read_text())
    init = resolved["model"]["path"]
    q = max(len(rows) // 4, 1)
    first = sum(r["rollout/reward_mean"] for r in rows[:q]) / q if "rollout/reward_mean" in rows[0] else float("nan")
    last = sum(r["rollout/reward_mean"] for r in rows[-q:]) / q if "rollout/reward_mean" in rows[0] else float("nan")
    mism = sum(int(r.get("train/image_token_mismatches", 0)) for r in rows)
    image_tokens = sum(int(r.get("train/image_tokens", 0)) for r in rows)
    env_args = dict(cfg.rollout.env_args)
    res: dict[str, Any] = {"config": Path(a.config).name, "steps": len(rows), "run_wall_s": round(wall, 1),
                           "train_reward_first_quarter": round(first, 3), "train_reward_last_quarter": round(last, 3),
                           "image_token_mismatches": mism, "image_tokens_trained": image_tokens}
    for name, temp in (("sampled", 1.0), ("greedy", 0.0)):
        before = asyncio.run(heldout_reward(init, init, env_args, a.heldout, temp, cfg.rollout.env))
        after = asyncio.run(heldout_reward(str(Path(run_dir) / "final_hf"), init, env_args, a.heldout, temp,
                                           cfg.rollout.env))
        res[f"heldout_{name}_before"], res[f"heldout_{name}_after"] = round(before, 3), round(after, 3)
        res[f"heldout_{name}_rise"] = round(after - before, 3)
    lines = [f"VLM recipe on CPU ({res['config']}, {res['steps']} RL steps, {a.heldout} held-out prompts, "
             f"launched `miles train` wall {res['run_wall_s']} s incl. the cached-or-not warm-up)",
             "| quantity | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in res.items() if k not in ("config",)]
    text = "\n".join(lines)
    print(text)
    name = a.name or ("vlm_multiturn_cpu" if "multiturn" in Path(a.config).name else "vlm_cpu")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.txt").write_text(text + "\n" + json.dumps(res) + "\n")
    (OUT / f"{name}.json").write_text(json.dumps({**res, "curve": [r.get("rollout/reward_mean") for r in rows]}))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
