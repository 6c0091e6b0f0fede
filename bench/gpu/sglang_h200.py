"""H200 check of `SGLangEngine` against a stock SGLang 0.5.17 server (recipe: bench/gpu/README.md).

On a tiny random Qwen3-MoE saved by miles in HF layout, miles drives the server through the
engine contract and checks: generate with logprobs + routed experts; logprob agreement
with miles' own model (teacher-forced, bf16, same GPU) and routed-expert agreement with
miles' router; pause(retract)/resume; a weight update through stage/commit (update from
disk) with the version in every response and a read-back checksum compare; flush_cache;
throughput against the embedded TorchEngine on the same model and workload; and a
restart after the server is killed. Raw responses are saved for the CPU tests
(tests/data/sglang_h200/). Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, GenerateResult, SamplingParams
from miles.engines.sglang import SGLangEngine
from miles.engines.sglang_wire import generate_payload, parse_generate
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.hf_io import hf_tensor_views, save_model, tensor_checksum
from miles.models.logprobs import token_logprobs
from miles.models.presets import tiny_config
from miles.models.registry import build_model

T0 = time.monotonic()
CFG = tiny_config("qwen3_moe", vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=128, max_position_embeddings=4096)


def stamp(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def make_model(seed: int, std: float) -> torch.nn.Module:
    m = build_model(ModelSpec.from_hf(CFG), dtype=torch.float32)
    m.init_weights(seed, std=std)
    return m.to(torch.bfloat16)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG["vocab_size"], (length,), generator=g).tolist() for _ in range(n)]


@torch.no_grad()
def teacher_forced(model: Any, res: list[GenerateResult], reqs: list[GenerateRequest]) -> dict[str, float]:
    """miles' logprobs of SGLang's sampled tokens, and miles' router choice on the same tokens."""
    dl, match_rows, rows = [], 0, 0
    for req, r in zip(reqs, res, strict=True):
        ids = torch.tensor([req.input_ids + r.output_ids], device="cuda")
        out = model(ids, return_routed_experts=True)
        p = len(req.input_ids)
        lp = token_logprobs(out.logits[0, p - 1 : -1], ids[0, p:], req.sampling.temperature)
        dl.append((lp.cpu() - torch.tensor(r.logprobs)).abs())
        if r.routed_experts is not None:
            # the fed tokens only: a finished request's last row repeats the one before (sglang_wire.py)
            fed = r.routed_experts[:-1] if r.finish_reason != "abort" else r.routed_experts
            mine = out.routed_experts[0, : fed.shape[0]].sort(-1).values.cpu()
            theirs = torch.from_numpy(fed.astype("int64")).sort(-1).values
            same = (mine == theirs).all(-1)  # [T-1, L]
            match_rows += int(same.all(-1).sum())
            rows += same.shape[0]
    d = torch.cat(dl)
    return {"logprob_mean_abs_diff": float(d.mean()), "logprob_max_abs_diff": float(d.max()),
            "tokens_compared": int(d.numel()), "routed_rows_all_layers_match": match_rows / max(rows, 1),
            "routed_rows": rows}


async def throughput(engine: Any, batch: int, new: int, seed: int) -> float:
    reqs = [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=new, seed=seed + i))
            for i, p in enumerate(prompts(batch, 32, seed))]
    t = time.perf_counter()
    res = await asyncio.gather(*(engine.generate(r) for r in reqs))
    dt = time.perf_counter() - t
    return sum(len(r.output_ids) for r in res) / dt


async def main(out: Path) -> dict[str, Any]:
    R: dict[str, Any] = {"kind": "nvidia-h200", "date": datetime.datetime.now(datetime.UTC).isoformat(),
                         "commit": os.environ.get("MILES_COMMIT", ""), "sglang": "0.5.17", "model": CFG}
    raw: dict[str, Any] = {"source": "stock SGLang 0.5.17 on one H200, bench/gpu/sglang_h200.py", "model": CFG}
    work = Path("/tmp/miles-sglang-bench")
    base = work / "base"
    m0 = make_model(0, 0.08)
    save_model(m0, base)
    cfg = EngineConfig(type="sglang", dtype="bfloat16", sglang_model_path=str(base), sglang_port=30111,
                       sglang_return_routed_experts=True, max_batch_size=128,
                       max_seq_len=4096, sglang_python="python3", sglang_startup_timeout_s=330,
                       sglang_request_timeout_s=120, sglang_stage_dir=str(work),
                       sglang_extra_args=["--attention-backend", "triton", "--sampling-backend", "pytorch",
                                          "--grammar-backend", "none", "--disable-cuda-graph",
                                          "--skip-server-warmup"])
    eng = SGLangEngine(cfg)
    try:
        return await checks(eng, R, raw, m0, out)
    finally:
        await eng.close()


async def checks(eng: SGLangEngine, R: dict[str, Any], raw: dict[str, Any], m0: Any, out: Path) -> dict[str, Any]:
    t = time.monotonic()
    await eng.start()
    R["server_start_s"] = time.monotonic() - t
    stamp(f"server up in {R['server_start_s']:.0f}s, version {eng.version}")

    # 1. generate with logprobs + routed experts; raw bodies recorded for the CPU tests
    reqs = [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=24, seed=100 + i),
                            return_routed_experts=True) for i, p in enumerate(prompts(6, 20, 1))]
    reqs.append(GenerateRequest(prompts(1, 12, 2)[0], SamplingParams(temperature=0.0, max_new_tokens=16,
                                                                      stop_token_ids=[7, 11]),
                                return_routed_experts=True))
    bodies = await asyncio.gather(*(eng._call("POST", "/generate", generate_payload(r)) for r in reqs))
    raw["generate"] = [{"request": generate_payload(r), "response": b} for r, b in zip(reqs, bodies, strict=True)]
    res = [parse_generate(b, r, eng.facts) for r, b in zip(reqs, bodies, strict=True)]
    R["meta_info_keys"] = sorted(bodies[0]["meta_info"])
    R["routed_experts_shape"] = list(res[0].routed_experts.shape)
    R["routed_experts_dtype"] = str(res[0].routed_experts.dtype)
    R["finish_reasons"] = [r.finish_reason for r in res]
    model = m0.to("cuda")
    R["agreement_v0"] = teacher_forced(model, res, reqs)
    stamp(f"agreement v0 {R['agreement_v0']}")

    # 2. pause(retract) with requests running, then resume; the next request runs
    long = [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=3000, seed=i))
            for i, p in enumerate(prompts(8, 16, 3))]
    tasks = [asyncio.create_task(eng.generate(r)) for r in long]
    await asyncio.sleep(1.0)
    got = await eng.pause("retract")
    done = await asyncio.gather(*tasks, return_exceptions=True)
    R["pause_retract"] = {"returned": len(got), "retracted": sum(r.retracted for r in got),
                          "partial_tokens": [len(r.output_ids) if isinstance(r, GenerateResult) else repr(r)[:120]
                                             for r in done],
                          "finish": sorted({r.finish_reason if isinstance(r, GenerateResult) else "error"
                                            for r in done})}
    await eng.resume()
    after = await eng.generate(GenerateRequest(prompts(1, 8, 4)[0], SamplingParams(temperature=0.0, max_new_tokens=8)))
    R["pause_retract"]["after_resume_tokens"] = len(after.output_ids)
    stamp(f"pause/resume {R['pause_retract']}")

    # 3. weight update: stage two buckets of v1, commit while paused, read back, compare
    greedy = GenerateRequest(prompts(1, 16, 5)[0], SamplingParams(temperature=0.0, max_new_tokens=16))
    before = await eng.generate(greedy)
    m1 = make_model(1, 0.08)
    hf1 = {k: v.detach().clone() for k, v in hf_tensor_views(m1).items()}
    names = sorted(hf1)
    await eng.pause("abort")
    with_partial = {}
    try:
        await eng.commit(1)
    except Exception as exc:  # noqa: BLE001 - recording the refusal is the check
        with_partial["commit_unstaged_error"] = str(exc)[:160]
    half = len(names) // 2
    await eng.stage(1, [(n, hf1[n]) for n in names[:half]])
    try:
        await eng.commit(1)
    except Exception as exc:  # noqa: BLE001
        with_partial["commit_partial_error"] = str(exc)[:160]
    await eng.stage(1, {n: hf1[n] for n in names[half:]})
    t = time.monotonic()
    await eng.commit(1)
    commit_s = time.monotonic() - t
    await eng.resume()
    after_upd = await eng.generate(greedy)
    info = await eng._call("GET", "/get_model_info")
    raw["model_info_after_commit"] = info
    check = [n for n in names if n.endswith(("embed_tokens.weight", "norm.weight", "mlp.gate.weight"))
             or n == "lm_head.weight"]
    try:
        served = await eng.served_checksums(check)
        staged = {n: tensor_checksum(hf1[n].to(torch.bfloat16)) for n in check}
        cks: dict[str, Any] = {"compared": len(check), "equal": sum(served[n] == staged[n] for n in check)}
    except Exception as exc:  # noqa: BLE001 - some names may not be readable on this server
        cks = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    disk_equal = eng.checksums() == {n: tensor_checksum(hf1[n].to(torch.bfloat16)) for n in names}
    R["weight_update"] = {**with_partial, "commit_s": commit_s, "versions_after": sorted(set(after_upd.versions)),
                          "model_info_weight_version": info.get("weight_version"),
                          "greedy_changed": before.output_ids != after_upd.output_ids,
                          "served_checksums": cks, "disk_checksums_equal": disk_equal}
    stamp(f"weight update {R['weight_update']}")
    reqs2 = [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=24, seed=200 + i),
                             return_routed_experts=True) for i, p in enumerate(prompts(4, 20, 6))]
    res2 = await asyncio.gather(*(eng.generate(r) for r in reqs2))
    R["agreement_v1"] = teacher_forced(m1.to("cuda"), res2, reqs2)
    await eng.flush_cache()
    R["flush_cache"] = "ok"
    stamp(f"agreement v1 {R['agreement_v1']}")

    # 4. throughput vs the embedded engine, same model, same workload (batch 64 x 128 new tokens)
    del model
    await throughput(eng, 8, 16, 9)
    R["sglang_tok_s"] = await throughput(eng, 64, 128, 10)
    te = TorchEngine(m1.to("cuda"), EngineConfig(device="cuda", dtype="bfloat16", max_batch_size=64))
    await throughput(te, 8, 16, 9)
    R["torch_engine_tok_s"] = await throughput(te, 64, 128, 10)
    await te.close()
    R["sglang_vs_torch_engine"] = R["sglang_tok_s"] / R["torch_engine_tok_s"]
    stamp(f"tok/s sglang {R['sglang_tok_s']:.0f} torch {R['torch_engine_tok_s']:.0f}")

    # 5. crash: kill the server's process group; the next request fails, the one after restarts it
    if time.monotonic() - T0 < 330 and eng.server is not None and eng.server._proc is not None:
        os.killpg(eng.server._proc.pid, signal.SIGKILL)
        await asyncio.to_thread(eng.server._proc.wait)
        crash: dict[str, Any] = {}
        try:
            await eng.generate(greedy)
        except Exception as exc:  # noqa: BLE001
            crash["first_error"] = str(exc)[:160]
        t = time.monotonic()
        again = await eng.generate(greedy)
        crash.update(restart_s=time.monotonic() - t, restarts=eng.server.restarts,
                     version_after_restart=sorted(set(again.versions)),
                     same_greedy_as_before_crash=again.output_ids == after_upd.output_ids)
        R["restart"] = crash
        stamp(f"restart {crash}")
    else:
        R["restart"] = "skipped: not enough time left in the device call"
    (out / "sglang_h200_raw.json").write_text(json.dumps(raw))
    return R


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/out")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MILES_COMMIT", subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                         text=True).stdout.strip())
    result = asyncio.run(main(out))  # main closes the engine (and its server) on every exit path
    (out / "sglang_h200.json").write_text(json.dumps(result, indent=1))
    for k, v in result.items():
        if k != "model":
            print(f"{k:28s} {v}")
    print(json.dumps(result))
