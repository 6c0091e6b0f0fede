"""Evaluation: greedy answers on a held-out prompt set, scored by the environment's reward.

Greedy accuracy on every eval prompt, and with `eval.samples = k` also avg@k and pass@k; the
env's own scorers (GSM8K: strict and lenient answer extraction) as eval/accuracy_<name>; with
`eval.full_at_ends`, the step-0 and final evaluations over every eval row as eval/full/*.
Used by all three eval modes: `shared` runs it on the rollout engines (from the
rollout actor, after new generation has drained), `snapshot` on a dedicated eval
engine that received a weight snapshot, and `external` hands an exported checkpoint
to a user command instead.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import shlex
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any

from miles.actors.eval_requests import Reply, generate_through_pauses
from miles.actors.messages import GenerateMany
from miles.actors.runtime.host_view import ActorHost
from miles.core.errors import MilesError
from miles.core.generation import GenerateFailed, GenerateResult
from miles.core.hooks import resolve_hook
from miles.core.schema import MilesConfig
from miles.rollout.tokens.tokenizer import Tokenizer
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
    the same numbers wherever the engine's sampling is deterministic. A `full` evaluation also
    greedy-decodes every other row of a finite eval set and reports eval/full/* over all rows.
    The env's scorers (rollout/envs/base.py) score every greedy answer: eval/accuracy_<name>."""

    def __init__(self, cfg: MilesConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tok = tokenizer
        make = resolve_hook(cfg.rollout.env, "rollout.env")
        args = {**cfg.rollout.env_args, **cfg.eval.env_args}
        self.env = make(**args)
        self.prompts = [self.env.prompts.item(i) for i in range(cfg.eval.num_prompts)]

    def all_prompts(self) -> list[dict[str, Any]]:
        """Every row of the eval set, once (the subset's first, in the same order)."""
        src = self.env.prompts
        if not isinstance(src, Sized):
            raise EvalError(f"eval.full_at_ends: the eval env {self.env.name!r} serves an endless prompt stream; "
                            "a full evaluation needs a finite eval set (the dataset or gsm8k env)")
        return [self.env.prompts.item(i) for i in range(len(src))]

    def _response(self, r: GenerateResult) -> str:
        out = [t for t in r.output_ids if t not in self.tok.stop_token_ids]
        return self.tok.decode(out, skip_special_tokens=True)

    async def _score(self, p: dict[str, Any], ids: list[int], r: GenerateResult) -> float:
        n = len(r.output_ids)
        s = Sample(prompt_ids=ids, response_ids=r.output_ids, loss_mask=[1] * n,
                   rollout_logprobs=r.logprobs, versions=r.versions,
                   metadata={"response": self._response(r)})
        rew = self.env.reward(p, s)
        if inspect.isawaitable(rew):
            rew = await rew
        return float(rew)

    async def evaluate(self, host: ActorHost, engines: list[str], full: bool = False) -> dict[str, float]:
        """Greedy-decode every eval prompt, plus k samples each (spread over `engines`); score them.
        full: also greedy-decode the rest of the eval set (no samples there)."""
        ec = self.cfg.eval
        k = ec.samples
        base = {"max_new_tokens": ec.max_new_tokens, "stop_token_ids": self.tok.stop_token_ids}
        greedy = {**base, "temperature": 0.0}
        prompts = self.prompts
        if full:
            ids_seen = {p["id"] for p in prompts}
            prompts = prompts + [p for p in self.all_prompts() if p["id"] not in ids_seen]

        async def one(i: int, p: dict[str, Any]) -> Scored:
            text = self.tok.apply_chat_template(p["messages"], add_generation_prompt=True)
            ids = self.tok.encode(text)
            n_samples = k if i < len(self.prompts) else 0
            sampling = [greedy] + [{**base, "temperature": ec.temperature, "seed": 1_000 * i + j}
                                   for j in range(n_samples)]
            ref = host.ref(engines[i % len(engines)])

            async def ask(prompts: list[list[int]], params: list[dict[str, Any]]) -> list[Reply]:
                out: list[Reply] = await ref.ask(GenerateMany(prompts, params), timeout=ec.timeout_s)
                return out

            replies, again = await generate_through_pauses(ask, ids, sampling)
            rs = [_answer(r) for r in replies]
            scores = [await self._score(p, ids, r) for r in rs]
            answer = self._response(rs[0])
            extra = {name: float(fn(p, answer)) for name, fn in self.env.scorers.items()}
            return Scored(scores[0], scores[1:], float(len(rs[0].output_ids)), extra, again)

        res = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        m = self._greedy_metrics("eval/", res[:len(self.prompts)])
        # answers handed back at a weight push and continued (actors/eval_requests.py)
        m["eval/resubmits"] = float(sum(r.resubmits for r in res))
        if k:
            sub, ok = res[:len(self.prompts)], ec.correct_reward
            m[f"eval/avg_at_{k}"] = sum(sum(r.samples) / k for r in sub) / len(sub)
            m[f"eval/pass_at_{k}"] = sum(pass_at_k(sum(x >= ok for x in r.samples), k, k) for r in sub) / len(sub)
            m["eval/samples"] = float(k)
        if full:
            m.update(self._greedy_metrics("eval/full/", res))
        return m

    def _greedy_metrics(self, prefix: str, res: list[Scored]) -> dict[str, float]:
        n, ok = len(res), self.cfg.eval.correct_reward
        m = {f"{prefix}reward_mean": sum(r.greedy for r in res) / n,
             f"{prefix}greedy_accuracy": sum(r.greedy >= ok for r in res) / n,
             f"{prefix}response_len_mean": sum(r.length for r in res) / n,
             f"{prefix}num_prompts": float(n)}
        for name in self.env.scorers:
            m[f"{prefix}accuracy_{name}"] = sum(r.extra[name] for r in res) / n
        return m


@dataclass
class Scored:
    """One eval prompt: the greedy answer's reward, the k samples' rewards, the greedy answer's
    length in tokens, the env scorers' values for the greedy answer, and how many of its requests
    were handed back at a weight push and resubmitted."""

    greedy: float
    samples: list[float]
    length: float
    extra: dict[str, float]
    resubmits: int = 0


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


def _answer(r: Reply) -> GenerateResult:
    if isinstance(r, GenerateFailed):
        raise EvalError(f"eval generation failed: {r.error_type}: {r.error}")
    return r
