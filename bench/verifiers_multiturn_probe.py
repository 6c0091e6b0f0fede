"""Why the multi-turn verifiers example cannot learn on CPU at SmolLM2-135M's size, by measurement:
the first turn of SmolLM2-135M-Instruct on examples/verifiers_sums.py:ToolSumTaskset (system
prompt with one worked tool-call line), sampled at temperature 1 as RL samples it. If no reply
calls a tool and none answers a * b + c right, every group's rewards are all 0, so every
group-relative advantage is 0 and RL has nothing to learn from.

    python bench/verifiers_multiturn_probe.py [--n 24]
Prints one JSON line; saves bench/results/verifiers_multiturn_smollm2_probe.json.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--model", default="/tmp/smollm2-hf")
    a = ap.parse_args()
    import torch
    import transformers

    from miles.rollout.envs.verifiers_env import make_env

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    m = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    env = make_env("miles.examples.verifiers_sums:ToolSumTaskset", {"seed": 7}, size=max(32, a.n))
    calls = wellformed = right = 0
    examples: list[str] = []
    for i in range(a.n):
        p = env.prompts.item(i)
        ids = tok.apply_chat_template(p["messages"], add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.no_grad():
            g = m.generate(ids, max_new_tokens=40, do_sample=True, temperature=1.0, top_p=1.0)
        t = tok.decode(g[0, ids.shape[1]:], skip_special_tokens=True)
        call = re.search(r"<tool_call>(.*?)</tool_call>", t, re.S)
        calls += bool(call)
        if call:
            try:
                c = json.loads(call.group(1))
                wellformed += c.get("name") in ("add", "mul") and isinstance(c.get("arguments"), dict)
            except json.JSONDecodeError:
                pass
        nums = re.findall(r"-?\d+", t)
        right += bool(nums) and not call and int(nums[-1]) == env.prompts.task(i).data.answer
        if i < 4:
            examples.append(t[:120])
    res = {"bench": "verifiers_multiturn_probe", "model": "SmolLM2-135M-Instruct", "n": a.n,
           "tool_call_tags": calls, "wellformed_calls": wellformed, "direct_right_answers": right,
           "examples": examples}
    Path(REPO / "bench" / "results" / "verifiers_multiturn_smollm2_probe.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
