"""Evaluation: greedy answers on a held-out prompt set, scored by the environment's reward.

Used by all three eval modes: `shared` runs it on the rollout engines (from the
rollout actor, after new generation has drained), `snapshot` on a dedicated eval
engine that received a weight snapshot, and `external` hands an exported checkpoint
to a user command instead.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from typing import Any

from miles.actors.messages import Generate
from miles.actors.runtime.host import Host
from miles.core.hooks import resolve_hook
from miles.core.schema import MilesConfig
from miles.rollout.tokenizer import Tokenizer
from miles.rollout.types import Sample


class Evaluator:
    def __init__(self, cfg: MilesConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tok = tokenizer
        make = resolve_hook(cfg.rollout.env, "rollout.env")
        args = {**cfg.rollout.env_args, **cfg.eval.env_args}
        self.env = make(**args)
        self.prompts = [self.env.prompts.item(i) for i in range(cfg.eval.num_prompts)]

    async def evaluate(self, host: Host, engines: list[str]) -> dict[str, float]:
        """Greedy-decode every eval prompt (spread over `engines`) and average the reward."""
        ec = self.cfg.eval
        sampling = {"temperature": 0.0, "max_new_tokens": ec.max_new_tokens,
                    "stop_token_ids": self.tok.stop_token_ids}

        async def one(i: int, p: dict[str, Any]) -> tuple[float, int]:
            text = self.tok.apply_chat_template(p["messages"], add_generation_prompt=True)
            ids = self.tok.encode(text)
            r = await host.ref(engines[i % len(engines)]).ask(
                Generate(ids, sampling), timeout=ec.timeout_s)
            out = [t for t in r["output_ids"] if t not in self.tok.stop_token_ids]
            n = len(r["output_ids"])
            s = Sample(prompt_ids=ids, response_ids=r["output_ids"], loss_mask=[1] * n,
                       rollout_logprobs=r["logprobs"], versions=r["versions"],
                       metadata={"response": self.tok.decode(out, skip_special_tokens=True)})
            rew = self.env.reward(p, s)
            if asyncio.iscoroutine(rew):
                rew = await rew
            return float(rew), len(r["output_ids"])

        res = await asyncio.gather(*(one(i, p) for i, p in enumerate(self.prompts)))
        return {"eval/reward_mean": sum(r for r, _ in res) / len(res),
                "eval/response_len_mean": sum(n for _, n in res) / len(res),
                "eval/num_prompts": float(len(res))}


async def run_external(command: str, checkpoint: str, step: int, timeout_s: float) -> dict[str, float]:
    """Run the user's command on an exported checkpoint; its last stdout line may be JSON metrics."""
    cmd = command.replace("{checkpoint}", shlex.quote(checkpoint)).replace("{step}", str(step))
    proc = await asyncio.create_subprocess_shell(cmd, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    metrics: dict[str, float] = {"eval/external_exit_code": float(proc.returncode or 0)}
    lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
    if lines:
        try:
            obj = json.loads(lines[-1])
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            metrics.update({f"eval/external/{k}": float(v) for k, v in obj.items()
                            if isinstance(v, int | float) and not isinstance(v, bool)})
    return metrics
