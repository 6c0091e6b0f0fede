"""TRL's GRPOTrainer on the learning gate's GSM8K task: same checkpoint, data, prompt, reward,
batch and optimiser settings as examples/gsm8k.toml, for the miles-vs-TRL time-to-accuracy.

    python bench/learn_trl.py --model /tmp/smollm2-hf --data DIR [--device cuda] [--time-limit 300]

Data: GSM8K train/test (DIR/train.jsonl, DIR/test.jsonl) through miles' gsm8k env (the
max_calc_steps cut, the prompt template, the math reward); 16 prompts x 8 samples per step,
256 new tokens, temperature 1, lr 5e-6 constant, grad clip 1, no KL, bf16 on CUDA. TRL
generates with transformers' `generate` (its default without vLLM, which the device lacks).
Held-out greedy accuracy on the first 128 test rows of the cut, before training and at the
end, by transformers' greedy `generate` scored by the same reward. Training stops at the
first step after --time-limit seconds. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/smollm2-hf")
    ap.add_argument("--data", default="../shared/data/gsm8k", help="folder with train.jsonl and test.jsonl")
    ap.add_argument("--max-calc-steps", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--time-limit", type=float, default=300.0, help="stop at the first step after this [s]")
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--eval-prompts", type=int, default=128)
    ap.add_argument("--eval-batch", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reward-extract", default="auto", choices=["auto", "hash", "boxed"],
                    help="the math reward's answer extraction, as miles' rollout.env_args.rewards sets it")
    ap.add_argument("--rewards", default="",
                    help="the rewards list as JSON (as miles' rollout.env_args.rewards), e.g. a shaped "
                         "strict + lenient pair; overrides --reward-extract")
    ap.add_argument("--micro-batch", type=int, default=0,
                    help="sequences per forward/backward (gradient accumulation over prompts x samples, with "
                         "gradient checkpointing); 0 = the whole batch at once")
    a = ap.parse_args()
    t_launch = time.time()

    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from miles.rollout.envs.gsm8k import make_env
    from miles.rollout.types import Sample

    template = "{prompt}\nThink step by step, then give the final answer as a number after ####."
    common = {"path": f"{a.data}/train.jsonl", "eval_path": f"{a.data}/test.jsonl",
              "max_calc_steps": a.max_calc_steps, "prompt_template": template,
              "rewards": json.loads(a.rewards) if a.rewards else [{"type": "math", "extract": a.reward_extract}]}
    env = make_env(**common)
    test = make_env(**common, split="eval")
    torch.manual_seed(a.seed)
    n_items = a.max_steps * a.prompts
    items = [env.prompts.item(i) for i in range(n_items)]
    ds = Dataset.from_list([{"prompt": it["messages"], "label": it["answer"]} for it in items])

    def score(label: str, text: str) -> float:
        return float(env.reward({"label": label}, Sample(prompt_ids=[0], metadata={"response": text})))

    def reward(completions: list[Any], label: list[str], **_: Any) -> list[float]:
        return [score(lb, c[0]["content"] if isinstance(c, list) else str(c))
                for c, lb in zip(completions, label, strict=True)]

    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    if tok.pad_token is None:  # the GGUF-built tokenizer has none; the end token pads (masked out)
        tok.pad_token = tok.eos_token
    dev = torch.device(a.device)

    @torch.no_grad()
    def evaluate(model: Any) -> float:
        model.eval()
        rows = [test.prompts.item(i) for i in range(a.eval_prompts)]
        right = 0.0
        for k in range(0, len(rows), a.eval_batch):
            chunk = rows[k:k + a.eval_batch]
            texts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
                     for r in chunk]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(dev)
            out = model.generate(**enc, do_sample=False, max_new_tokens=a.max_new_tokens,
                                 pad_token_id=tok.pad_token_id or tok.eos_token_id)
            for r, o in zip(chunk, out[:, enc["input_ids"].shape[1]:], strict=True):
                right += score(r["answer"], tok.decode(o, skip_special_tokens=True)) >= 1.0
        model.train()
        return right / len(rows)

    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(dev)
    t0 = time.time()
    acc_before = evaluate(model)
    eval_before_s = time.time() - t0

    state: dict[str, Any] = {"t_train0": 0.0, "landed": [], "reward": []}

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            state["t_train0"] = time.time()

        def on_step_end(self, args: Any, st: Any, control: Any, **kw: Any) -> None:
            state["landed"].append(time.time() - state["t_train0"])
            if time.time() - state["t_train0"] > a.time_limit:
                control.should_training_stop = True

        def on_log(self, args: Any, st: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                state["reward"].append(float(logs["reward"]))

    gpu = a.device == "cuda"
    batch = a.prompts * a.samples
    micro = a.micro_batch or batch
    if batch % micro:
        ap.error(f"--micro-batch {micro} must divide prompts x samples = {batch}")
    cfg = GRPOConfig(
        # one optimizer step per prompts x samples, as miles takes (the same batch, in micro-batches)
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro, generation_batch_size=batch,
        num_generations=a.samples, max_completion_length=a.max_new_tokens, temperature=1.0,
        learning_rate=a.lr, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=1.0, beta=0.0, num_iterations=1, max_steps=a.max_steps, logging_steps=1,
        report_to="none", use_cpu=not gpu, bf16=gpu, fp16=False, gradient_checkpointing=micro < batch,
        save_strategy="no", shuffle_dataset=False, disable_tqdm=True, seed=a.seed,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    train_s = time.time() - state["t_train0"]
    acc_after = evaluate(trainer.model)
    import trl

    res = {"framework": f"trl {trl.__version__} GRPOTrainer (transformers generate)",
           "device": torch.cuda.get_device_name() if gpu else "cpu", "steps": len(state["landed"]),
           "train_s": round(train_s, 1), "eval_accuracy_before": acc_before, "eval_accuracy_after": acc_after,
           "eval_prompts": a.eval_prompts, "eval_before_s": round(eval_before_s, 1),
           "step_s_median": sorted(b - c for b, c in zip(state["landed"], [0.0, *state["landed"]][:-1],
                                                         strict=True))[len(state["landed"]) // 2]
           if state["landed"] else None,
           "reward": state["reward"], "landed_s": [round(x, 2) for x in state["landed"]],
           "batch": f"{a.prompts} prompts x {a.samples} samples", "micro_batch": micro,
           "max_new_tokens": a.max_new_tokens,
           "lr": a.lr, "reward_extract": a.reward_extract, "rewards": common["rewards"], "launch_to_end_s": round(time.time() - t_launch, 1)}
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
