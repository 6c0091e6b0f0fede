"""Evaluation: greedy answers on a held-out prompt set, scored by the environment's reward.

Greedy accuracy on every eval prompt, and with `eval.samples = k` also avg@k and pass@k.
Used by all three eval modes: `shared` runs it on the rollout engines (from the
rollout actor, after new generation has drained), `snapshot` on a dedicated eval
engine that received a weight snapshot, and `external` hands an exported checkpoint
to a user command instead.
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
from typing import Any

from miles.actors.messages import GenerateMany
from miles.actors.runtime.host import Host
from miles.core.errors import MilesError
from miles.core.hooks import resolve_hook
from miles.core.schema import MilesConfig
from miles.rollout.tokenizer import Tokenizer
from miles.rollout.types import Sample


class EvalError(MilesError):
    """An eval request came back with an error instead of an answer."""


def pass_at_k(correct: int, n: int, k: int) -> float:
    """Unbiased pass@k from n samples with `correct` right ones (Chen et al. 2021): the chance
    that k drawn without replacement hold at least one right answer."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


class Evaluator:
    """Greedy accuracy, and with `eval.samples = k` avg@k and pass@k, on a fixed prompt set.

    The prompts are the first `eval.num_prompts` of the eval env (fixed across evaluations);
    the k samples of prompt i are seeded by (i, j), so two evaluations of the same weights give
    the same numbers wherever the engine's sampling is deterministic."""

    def __init__(self, cfg: MilesConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tok = tokenizer
        make = resolve_hook(cfg.rollout.env, "rollout.env")
        args = {**cfg.rollout.env_args, **cfg.eval.env_args}
        self.env = make(**args)
        self.prompts = [self.env.prompts.item(i) for i in range(cfg.eval.num_prompts)]

    async def _score(self, p: dict[str, Any], ids: list[int], r: dict[str, Any]) -> float:
        if "error" in r:
            raise EvalError(f"eval generation failed: {r.get('error_type')}: {r['error']}")
        out = [t for t in r["output_ids"] if t not in self.tok.stop_token_ids]
        n = len(r["output_ids"])
        s = Sample(prompt_ids=ids, response_ids=r["output_ids"], loss_mask=[1] * n,
                   rollout_logprobs=r["logprobs"], versions=r["versions"],
                   metadata={"response": self.tok.decode(out, skip_special_tokens=True)})
        rew = self.env.reward(p, s)
        if asyncio.iscoroutine(rew):
            rew = await rew
        return float(rew)

    async def evaluate(self, host: Host, engines: list[str]) -> dict[str, float]:
        """Greedy-decode every eval prompt, plus k samples each (spread over `engines`); score them."""
        ec = self.cfg.eval
        k = ec.samples
        base = {"max_new_tokens": ec.max_new_tokens, "stop_token_ids": self.tok.stop_token_ids}
        greedy = {**base, "temperature": 0.0}

        async def one(i: int, p: dict[str, Any]) -> tuple[float, list[float], float]:
            text = self.tok.apply_chat_template(p["messages"], add_generation_prompt=True)
            ids = self.tok.encode(text)
            sampling = [greedy] + [{**base, "temperature": ec.temperature, "seed": 1_000 * i + j} for j in range(k)]
            rs = await host.ref(engines[i % len(engines)]).ask(
                GenerateMany([ids] * len(sampling), sampling), timeout=ec.timeout_s)
            scores = [await self._score(p, ids, r) for r in rs]
            return scores[0], scores[1:], float(len(rs[0]["output_ids"]))

        res = await asyncio.gather(*(one(i, p) for i, p in enumerate(self.prompts)))
        n = len(res)
        ok = ec.correct_reward
        m = {"eval/reward_mean": sum(g for g, _, _ in res) / n,
             "eval/greedy_accuracy": sum(g >= ok for g, _, _ in res) / n,
             "eval/response_len_mean": sum(ln for _, _, ln in res) / n,
             "eval/num_prompts": float(n)}
        if k:
            m[f"eval/avg_at_{k}"] = sum(sum(s) / k for _, s, _ in res) / n
            m[f"eval/pass_at_{k}"] = sum(pass_at_k(sum(x >= ok for x in s), k, k) for _, s, _ in res) / n
            m["eval/samples"] = float(k)
        return m


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
