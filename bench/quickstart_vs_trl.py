"""miles' quick start against Hugging Face TRL's GRPOTrainer: same model, task, batch, steps.

    nice -n 10 python bench/quickstart_vs_trl.py [--repeat 3] [--steps N] [--trl-threads 1]
        [--trl-python PATH] [--make-trl-venv]

Both start from the same warmed-up checkpoint (the quick start's cached warm-up) and train
on miles' arithmetic env with its reward: `batch_groups` prompts x `n_samples_per_prompt`
samples per step, `max_new_tokens` new tokens, temperature 1, the quick start's LR with
AdamW betas (0.9, 0.98), constant schedule, grad clip 1.0, no KL, fp32, the machine's
threads. TRL runs in its own virtualenv (never a miles dependency): `--make-trl-venv`
creates one under /tmp with pip (CPU torch pinned first, then trl).

Measured from outside each command: whole-command wall time (process start to exit), and
the wall time at which each step landed (miles: its metrics.jsonl row, TRL: a callback),
giving launch -> first step, steps/s over the loop (first -> last step) and the median
interval between steps; and the CPU time (user + sys) of each whole process tree, which
a busy shared machine distorts less than wall time. `--repeat` pairs run back to back (order
alternating, seed + i for pair i); the table gives medians and the speed-ups are the medians of
the pairs' ratios. Prints a table; the last line is one JSON object; the result goes to
bench/results/quickstart_vs_trl_cpu.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "quickstart.toml"
RESULT = REPO / "bench" / "results" / "quickstart_vs_trl_cpu.txt"
TRL_VENV = Path("/tmp/miles-bench-trl-venv")
TRL_VERSION = "1.16.0"


# ----------------------------------------------------------------------------- TRL side
def trl_worker(a: argparse.Namespace) -> None:
    """Runs inside the TRL virtualenv: GRPOTrainer on miles' env; prints one JSON line."""
    t_launch = float(os.environ["BENCH_T0"])
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    # miles' env and reward, imported from this checkout (pure Python: numpy and stdlib)
    link = Path(tempfile.mkdtemp()) / "miles"
    link.symlink_to(REPO)
    sys.path.insert(0, str(link.parent))
    from miles.rollout.envs.arithmetic import make_env
    from miles.rollout.types import Sample

    if a.trl_threads:
        torch.set_num_threads(a.trl_threads)
    torch.manual_seed(a.seed)
    env = make_env(**json.loads(a.env_args))
    items = [env.prompts.item(i) for i in range(a.steps * a.prompts)]
    ds = Dataset.from_list([{"prompt": it["messages"], "answer": it["answer"], "question": it["question"]}
                            for it in items])

    def reward(completions: list[Any], answer: list[str], question: list[str], **_: Any) -> list[float]:
        out = []
        for c, ans, q in zip(completions, answer, question, strict=True):
            text = c[0]["content"] if isinstance(c, list) else str(c)
            out.append(float(env.reward({"answer": ans, "question": q},
                                        Sample(prompt_ids=[0], metadata={"response": text}))))
        return out

    landed: list[float] = []
    records: list[dict[str, float]] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            landed.append(time.time())

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                records.append({"reward": float(logs["reward"]),
                                "len": float(logs.get("completions/mean_length", 0.0))})

    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=a.prompts * a.samples,
        num_generations=a.samples, max_completion_length=a.max_new_tokens, temperature=1.0,
        learning_rate=a.lr, adam_beta1=0.9, adam_beta2=0.98, weight_decay=0.0, lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=1.0, beta=0.0, num_iterations=1, max_steps=a.steps, logging_steps=1,
        report_to="none", use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        save_strategy="no", shuffle_dataset=False, disable_tqdm=True, seed=a.seed,
    )
    tok = AutoTokenizer.from_pretrained(a.model)
    trainer = GRPOTrainer(model=a.model, reward_funcs=reward, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    print(json.dumps({"t_launch": t_launch, "landed": landed, "reward": [x["reward"] for x in records],
                      "completion_len": [x["len"] for x in records],
                      "threads": torch.get_num_threads()}), flush=True)


# ----------------------------------------------------------------------------- miles side
def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _follow(path: Path, landed: list[float], stop: threading.Event) -> None:
    """The wall time at which each metrics.jsonl row appears (polled every 5 ms)."""
    seen = 0
    while not stop.is_set():
        if path.is_file():
            n = path.read_bytes().count(b"\n")
            landed.extend([time.time()] * (n - seen))
            seen = max(seen, n)
        time.sleep(0.005)


def run_miles(sets: list[str], run_dir: Path, cache: str) -> dict[str, Any]:
    landed: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=_follow, args=(run_dir / "metrics.jsonl", landed, stop), daemon=True)
    t.start()
    t0, cpu0 = time.time(), _cpu_children()
    p = subprocess.run([sys.executable, "-m", "miles.launch.cli", "train", str(QUICKSTART),
                        "--set", f"run.dir={run_dir}", *[x for s in sets for x in ("--set", s)]],
                       capture_output=True, text=True, env={**os.environ, "MILES_CACHE": cache})
    wall, cpu = time.time() - t0, _cpu_children() - cpu0
    time.sleep(0.05)
    stop.set()
    t.join()
    if p.returncode != 0:
        raise SystemExit(f"miles run failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"t_launch": t0, "landed": landed[: len(rows)], "wall": wall, "cpu": cpu,
            "reward": [r["rollout/reward_mean"] for r in rows],
            "completion_tokens": sum(r.get("rollout/trained_response_tokens", 0.0) for r in rows),
            "stale_dropped": rows[-1].get("rollout/fully_async/stale_groups_filtered")}


def run_trl(py: str, model: str, a: argparse.Namespace, env_args: dict[str, Any], lr: float,
            shape: tuple[int, int, int]) -> dict[str, Any]:
    prompts, samples, new_tokens = shape
    t0, cpu0 = time.time(), _cpu_children()
    p = subprocess.run([py, __file__, "--trl-worker", "--model", model, "--steps", str(a.steps),
                        "--prompts", str(prompts), "--samples", str(samples),
                        "--max-new-tokens", str(new_tokens), "--lr", str(lr), "--seed", str(a.seed),
                        "--env-args", json.dumps(env_args), "--trl-threads", str(a.trl_threads)],
                       capture_output=True, text=True, env={**os.environ, "BENCH_T0": repr(t0),
                                                            **({"OMP_NUM_THREADS": str(a.trl_threads)}
                                                               if a.trl_threads else {})})
    wall, cpu = time.time() - t0, _cpu_children() - cpu0
    if p.returncode != 0:
        raise SystemExit(f"TRL run failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["wall"], out["cpu"] = wall, cpu
    out["completion_tokens"] = sum(x * prompts * samples for x in out["completion_len"])
    return out


def stats(r: dict[str, Any]) -> dict[str, float]:
    landed = r["landed"]
    loop = landed[-1] - landed[0]
    gaps = [b - a for a, b in zip(landed, landed[1:], strict=False)]
    rw = r["reward"]
    q = max(1, len(rw) // 4)
    return {"steps": len(landed), "whole_command_s": r["wall"], "whole_command_cpu_s": r["cpu"], "launch_to_first_step_s": landed[0] - r["t_launch"],
            "loop_s": loop, "steps_per_s": (len(landed) - 1) / loop if loop > 0 else 0.0,
            "median_s_per_step": statistics.median(gaps) if gaps else 0.0,
            "completion_tokens_per_s": r["completion_tokens"] / loop if loop > 0 else 0.0,
            "reward_first_quarter": sum(rw[:q]) / q, "reward_last_quarter": sum(rw[-q:]) / q}


def make_trl_venv(path: Path) -> str:
    py = path / "bin" / "python"
    if not py.exists():
        print(f"creating {path} (torch==2.13.0 CPU, trl=={TRL_VERSION}) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        pip = [str(path / "bin" / "pip"), "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU build, before trl pulls one
        # trl, and what importing miles' env and reward needs beyond trl's own dependencies
        subprocess.run([*pip, f"trl=={TRL_VERSION}", "msgspec"], check=True)
    return str(py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.0)
    ap.add_argument("--env-args", default="{}")
    ap.add_argument("--steps", type=int, default=0, help="steps for both (default: the quick start's)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first pair (pair i: seed + i)")
    ap.add_argument("--repeat", type=int, default=3, help="back-to-back miles/TRL pairs (medians reported)")
    ap.add_argument("--set", action="append", default=[], help="quick-start override for both, KEY=VALUE")
    ap.add_argument("--trl-python", default="", help="python of a virtualenv with trl (default: the one "
                    f"--make-trl-venv creates, {TRL_VENV})")
    ap.add_argument("--make-trl-venv", action="store_true")
    ap.add_argument("--trl-threads", type=int, default=0,
                    help="torch threads for TRL (default: torch's, one per core, as a user runs it)")
    ap.add_argument("--out", default=str(RESULT))
    a = ap.parse_args()
    if a.trl_worker:
        trl_worker(a)
        return
    sys.path.insert(0, str(REPO.parent))
    from miles.core.config import load_config
    from miles.core.logging import configure_logging
    from miles.core.schema import MilesConfig
    from miles.warmup.sft import ensure_initial_checkpoint

    configure_logging("warning")

    py = make_trl_venv(TRL_VENV) if a.make_trl_venv else (a.trl_python or str(TRL_VENV / "bin" / "python"))
    if not Path(py).exists():
        raise SystemExit(f"no TRL python at {py}: pass --trl-python or --make-trl-venv")
    cache = os.environ.get("MILES_CACHE", str(Path.home() / ".cache" / "miles"))
    os.environ["MILES_CACHE"] = cache
    base_seed, pairs, loads = a.seed, [], []
    for i in range(a.repeat):
        a.seed = base_seed + i  # a different seed per pair; miles and TRL share it
        sets = [*a.set, f"run.seed={a.seed}"] + ([f"run.steps={a.steps}"] if a.steps else [])
        cfg = load_config(MilesConfig, QUICKSTART, sets)
        steps = cfg.run.steps
        model = ensure_initial_checkpoint(cfg)  # the warm-up both start from, outside the timings
        shape = (cfg.buffer.batch_groups, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens)
        with tempfile.TemporaryDirectory() as tmp:
            # back to back, the order alternating, so load from others weighs on both alike
            def miles_run(tmp: str = tmp, sets: list[str] = sets) -> dict[str, float]:
                return stats(run_miles(sets, Path(tmp) / "miles", cache))

            def trl_run(cfg: Any = cfg, shape: tuple[int, int, int] = shape, model: str = model,
                        steps: int = steps) -> dict[str, float]:
                a.steps = steps
                return stats(run_trl(py, model, a, dict(cfg.rollout.env_args), cfg.trainer.optim.lr, shape))

            if i % 2 == 0:
                m = miles_run()
                t = trl_run()
            else:
                t = trl_run()
                m = miles_run()
        loads.append(os.getloadavg()[0])
        pairs.append({"seed": a.seed, "sets": sets, "miles": m, "trl": t, "loadavg": loads[-1],
                      "steps_per_s_x": m["steps_per_s"] / t["steps_per_s"],
                      "whole_command_x": t["whole_command_s"] / m["whole_command_s"]})
        print(f"pair {i + 1}/{a.repeat} seed {a.seed}: steps/s {pairs[-1]['steps_per_s_x']:.2f}x, "
              f"whole command {pairs[-1]['whole_command_x']:.2f}x, load {loads[-1]:.1f}", flush=True)
    m = {k: statistics.median(p["miles"][k] for p in pairs) for k in pairs[0]["miles"]}
    t = {k: statistics.median(p["trl"][k] for p in pairs) for k in pairs[0]["trl"]}
    keys = [("steps_per_s", "steps/s (loop)", ".2f"), ("median_s_per_step", "median s/step", ".3f"),
            ("loop_s", "loop, first -> last step [s]", ".1f"), ("whole_command_s", "whole command [s]", ".1f"),
            ("launch_to_first_step_s", "launch -> first step [s]", ".1f"),
            ("whole_command_cpu_s", "whole command, CPU time [s]", ".1f"),
            ("completion_tokens_per_s", "trained completion tokens/s", ".0f"),
            ("reward_first_quarter", "reward, first quarter", ".3f"),
            ("reward_last_quarter", "reward, last quarter", ".3f")]
    lines = [f"quickstart vs TRL {TRL_VERSION} GRPOTrainer, {steps} steps, {shape[0]} prompts x {shape[1]} "
             f"samples, {shape[2]} new tokens, lr {cfg.trainer.optim.lr}, {os.cpu_count()} cores, "
             f"TRL threads {a.trl_threads or 'default'}, medians of {a.repeat} back-to-back pairs "
             f"(seeds {base_seed}..{base_seed + a.repeat - 1}), load avg {min(loads):.1f}-{max(loads):.1f}",
             f"{'':32s} {'miles':>10s} {'TRL':>10s} {'miles/TRL':>10s}"]
    for k, name, fmt in keys:
        ratio = m[k] / t[k] if t[k] else float("nan")
        lines.append(f"{name:32s} {format(m[k], fmt):>10s} {format(t[k], fmt):>10s} {ratio:10.2f}")
    rise = [p["miles"]["reward_last_quarter"] - p["miles"]["reward_first_quarter"] for p in pairs]
    lines.append("miles reward rise per seed: " + ", ".join(f"{r:+.3f}" for r in rise))
    speed = {"steps_per_s_x": statistics.median(p["steps_per_s_x"] for p in pairs),
             "whole_command_x": statistics.median(p["whole_command_x"] for p in pairs)}
    lines.append("per pair (steps/s, whole command): " + ", ".join(
        f"{p['steps_per_s_x']:.2f}x/{p['whole_command_x']:.2f}x" for p in pairs))
    lines.append(f"speed vs TRL (median of pair ratios): steps/s {speed['steps_per_s_x']:.2f}x, "
                 f"whole command {speed['whole_command_x']:.2f}x (>1 = miles faster)")
    record = {"bench": "quickstart_vs_trl", "steps": steps, "repeat": a.repeat, "miles": m, "trl": t, **speed,
              "pairs": pairs, "trl_threads": a.trl_threads, "loadavg": loads}
    text = "\n".join(lines) + "\n" + json.dumps(record)
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
