"""Token drift of the three environment-hub adapters (reasoning-gym, OpenEnv, verifiers single-
and multi-turn), each run for --n trajectories on CPU through the real session store and the
torch engine (the tiny qwen3 preset with the tiny tokenizer: random weights, so replies are
arbitrary token strings, the hard case for re-tokenization).

Per trajectory it checks:
- drift: |trained tokens (loss mask 1) - tokens the engine sampled over all turns| (the audit
  every hub adapter's reward runs; goal 0);
- exact ids: the loss-mask-1 spans of the exported sample are, in order, exactly the engine's
  output ids of each turn, with the engine's logprobs (goal: 0 mismatches).
The OpenEnv env is examples/openenv_sum_env.py served on loopback by this script.

    python bench/env_adapters_cpu.py [--n 1000]
Prints a table and, last, one JSON line; saves bench/results/env_adapters_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GROUP = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_openenv(port: int, log: Path) -> subprocess.Popen[bytes]:
    # its output to a file: a pipe nobody reads fills up and blocks the server mid-run
    with log.open("wb") as f:
        proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "openenv_sum_env.py"), "--port", str(port)],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"openenv server exited: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("openenv server did not answer /health in 90 s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:  # uvicorn waits on open connections; this is our own child
        proc.kill()
        proc.wait(10)


def spans(mask: list[int], ids: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    prev = 0
    for m, t in zip(mask, ids, strict=True):
        if m and not prev:
            out.append([])
        if m:
            out[-1].append(t)
        prev = m
    return out


async def run_adapter(name: str, env: Any, engine: Any, tok: Any, n: int, max_turns: int) -> dict[str, Any]:
    from miles.engines.base import GenerateRequest, SamplingParams
    from miles.rollout.envs.hub_common import drift
    from miles.rollout.layers import GenerateContext, default_generate, load_layer
    from miles.rollout.tito.client import EngineOutput, LocalSessionClient
    from miles.rollout.tito.store import SessionStore

    store = SessionStore(tok, max_sessions=10_000)
    agent = load_layer("agent", env.agent)
    gate = asyncio.Semaphore(16)  # trajectories in flight (16 WebSocket sessions on the OpenEnv server)
    stats = {"trajectories": 0, "turns": 0, "sampled_tokens": 0, "drift_tokens": 0, "drifted": 0,
             "id_mismatches": 0, "logprob_mismatches": 0, "failed": 0, "reward_sum": 0.0}

    async def one(i: int) -> None:
        outs: list[EngineOutput] = []

        async def engine_fn(ids: list[int], sampling: dict[str, Any], **_: Any) -> EngineOutput:
            sp = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=tok.stop_token_ids)
            r = await engine.generate(GenerateRequest(ids, sp))
            o = EngineOutput(r.output_ids, r.logprobs, r.finish_reason, r.versions)
            outs.append(o)
            return o

        prompt = env.prompts.item(i // GROUP)  # GROUP trajectories of each prompt
        async with gate:
            try:
                [s] = await default_generate(GenerateContext(LocalSessionClient(store, engine_fn), prompt, agent,
                                                             env.tools, {"max_new_tokens": 16}, i % GROUP, max_turns))
            except Exception as exc:  # noqa: BLE001 - counted, the bench goes on
                stats["failed"] += 1
                print(f"{name}: trajectory {i} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                return
        d = drift(s)
        stats["trajectories"] += 1
        stats["turns"] += len(outs)
        stats["sampled_tokens"] += int(s.metadata["sampled_tokens"])
        stats["drift_tokens"] += d
        stats["drifted"] += int(d > 0)
        want = [o.ids for o in outs]
        got = spans(s.loss_mask, s.response_ids)
        # the session keeps an engine turn's ids whole, ending token included; a turn cut short
        # at 0 tokens has no span (none in practice: every turn samples at least one token)
        stats["id_mismatches"] += int(got != [w for w in want if w])
        lp = [x for x, m in zip(s.rollout_logprobs, s.loss_mask, strict=True) if m]
        stats["logprob_mismatches"] += int(lp != [x for o in outs for x in o.logprobs])
        if d == 0:
            stats["reward_sum"] += float(await env.reward(prompt, s))

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    stats["wall_s"] = round(time.monotonic() - t0, 1)
    stats["reward_mean"] = round(stats.pop("reward_sum") / max(1, stats["trajectories"]), 4)
    return {"adapter": name, **stats}


async def main_async(n: int) -> list[dict[str, Any]]:
    from miles.core.schema.engine import EngineConfig
    from miles.engines.torch_engine import TorchEngine
    from miles.models.config import ModelSpec
    from miles.models.presets import tiny_config
    from miles.models.registry import build_model
    from miles.rollout.envs import openenv_env, reasoning_gym_env, verifiers_env
    from miles.rollout.tokens.tiny_tokenizer import tiny_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="env_adapters_"))
    tok = tiny_tokenizer(tmp)
    model = build_model(ModelSpec.from_hf(tiny_config("qwen3", vocab_size=tok.vocab_size)), seed=0)
    engine = TorchEngine(model, EngineConfig(max_batch_size=64, max_seq_len=1024))
    port = free_port()
    server = start_openenv(port, tmp / "openenv_server.log")
    try:
        envs = [
            ("reasoning_gym:basic_arithmetic", reasoning_gym_env.make_env("basic_arithmetic", size=500), 1),
            ("openenv:sum_env (multi-turn)", openenv_env.make_env(f"http://127.0.0.1:{port}",
                                                                 observation_field="prompt"), 3),
            ("verifiers:SumTaskset", verifiers_env.make_env("miles.examples.verifiers_sums:SumTaskset"), 1),
            ("verifiers:ToolSumTaskset (tools)", verifiers_env.make_env(
                "miles.examples.verifiers_sums:ToolSumTaskset"), 3),
        ]
        return [await run_adapter(name, env, engine, tok, n, turns) for name, env, turns in envs]
    finally:
        await engine.close()
        stop(server)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="trajectories per adapter")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "env_adapters_cpu.json"))
    a = ap.parse_args()
    rows = asyncio.run(main_async(a.n))
    cols = ["adapter", "trajectories", "failed", "turns", "sampled_tokens", "drift_tokens", "drifted",
            "id_mismatches", "logprob_mismatches", "reward_mean", "wall_s"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    res = {"bench": "env_adapters_cpu", "n_per_adapter": a.n, "model": "tiny qwen3 preset, random weights",
           "tokenizer": "tiny tokenizer", "rows": rows,
           "total_drift_tokens": sum(r["drift_tokens"] for r in rows),
           "total_id_mismatches": sum(r["id_mismatches"] + r["logprob_mismatches"] for r in rows)}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
