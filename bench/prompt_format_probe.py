"""Which answer format does a checkpoint use under a given GSM8K prompt? (issue 44: the strict score)

    python bench/prompt_format_probe.py --model DIR --data ../shared/data/gsm8k/test.jsonl \
        [--questions 8] [--samples 4] [--max-new-tokens 320] [--variants hash,boxed,hash_line]

For each prompt variant: the first N test questions, k answers sampled at T=1 (the training regime)
and one greedy, through transformers `generate` on CPU or GPU. Reports the share of answers that
write `####`, that write `\\boxed{}`, and the share right under the strict scorers (hash: the number
after the last ####; boxed: inside the last \\boxed{}) and the lenient one (the last number). A
strict reward can only teach a format that some sampled answers already use. Prints a table and,
last, one JSON line; `--out` saves it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO.parent) not in sys.path:
    sys.path.insert(0, str(REPO.parent))

VARIANTS = {
    # the recipe's prompt (examples/gsm8k_qwen.toml)
    "hash": "{prompt}\nThink step by step, then give the final answer as a number after ####.",
    # the phrasing Qwen2.5's math instructions use
    "boxed": "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    # the #### format spelled out as a last line, without an example answer
    "hash_line": "{prompt}\nThink step by step. End your answer with a last line of the form: #### <number>",
}
# Variants that also put a system message first (the dataset env's `system_prompt`).
SYSTEM = {
    "hash_sys": "Solve the problem step by step. On the last line write the final answer as: #### <number>",
    "boxed_sys": "Please reason step by step, and put your final answer within \\boxed{}.",
}
VARIANTS |= {"hash_sys": "{prompt}", "boxed_sys": "{prompt}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="GSM8K test JSONL (question, answer)")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.rollout.rewards.rules import MathReward, extract_boxed, extract_hash

    rows = [json.loads(x) for x in Path(a.data).read_text().splitlines()[: a.questions]]
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(a.device).eval()
    scorers = {"hash": MathReward(extract="hash"), "boxed": MathReward(extract="boxed"),
               "lenient": MathReward(extract="auto")}

    def score(kind: str, label: str, text: str) -> float:
        from miles.rollout.types import Sample

        return float(scorers[kind]({"label": label}, Sample(prompt_ids=[0], metadata={"response": text})))

    results: list[dict[str, Any]] = []
    for name in a.variants.split(","):
        t0 = time.time()
        sys_msg = [{"role": "system", "content": SYSTEM[name]}] if name in SYSTEM else []
        msgs = [[*sys_msg, {"role": "user", "content": VARIANTS[name].format(prompt=r["question"])}] for r in rows]
        texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(a.device)
        out: dict[str, list[str]] = {}
        torch.manual_seed(0)
        with torch.no_grad():
            for mode, kw in (("sampled", {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                          "num_return_sequences": a.samples}),
                             ("greedy", {"do_sample": False})):
                gen = model.generate(**enc, max_new_tokens=a.max_new_tokens, pad_token_id=tok.pad_token_id, **kw)
                out[mode] = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for mode, answers in out.items():
            per = len(answers) // len(rows)
            labels = [rows[i // per]["answer"] for i in range(len(answers))]
            n = len(answers)
            res = {"variant": name, "mode": mode, "answers": n,
                   "writes_hash": sum(extract_hash(t) is not None for t in answers) / n,
                   "writes_boxed": sum(extract_boxed(t) is not None for t in answers) / n,
                   **{f"right_{k}": sum(score(k, lb, t) for lb, t in zip(labels, answers, strict=True)) / n
                      for k in scorers},
                   "example_tail": answers[0][-160:]}
            results.append(res)
        print(f"{name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"{'variant':<10} {'mode':<8} {'n':>3} {'####':>6} {'boxed':>6} {'R hash':>7} {'R boxed':>8} {'R last':>7}")
    for r in results:
        print(f"{r['variant']:<10} {r['mode']:<8} {r['answers']:>3} {r['writes_hash']:>6.2f} {r['writes_boxed']:>6.2f} "
              f"{r['right_hash']:>7.2f} {r['right_boxed']:>8.2f} {r['right_lenient']:>7.2f}")
    summary = {"model": a.model, "device": a.device, "questions": a.questions, "samples": a.samples,
               "max_new_tokens": a.max_new_tokens, "results": results}
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "results"} |
                     {"rows": [{k: v for k, v in r.items() if k != "example_tail"} for r in results]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
