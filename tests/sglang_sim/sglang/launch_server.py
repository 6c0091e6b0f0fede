"""A SIMULATION of SGLang 0.5.17's HTTP wire, for CPU tests. This is not SGLang.

`python -m sglang.launch_server ...` with this folder first on PYTHONPATH (tests/sglang_sim/python)
starts an aiohttp server on loopback that takes SGLang's launch flags and answers the endpoints
miles' SGLangEngine uses, in SGLang's request/response format (checked against the responses
recorded from a real 0.5.17 server on an H200, tests/data/sglang_h200/):

  POST /generate (input_ids, sampling_params, rid, return_logprob, return_routed_experts),
  POST /pause_generation {"mode"}, POST /continue_generation, POST /abort_request {"rid"},
  POST /flush_cache, POST /update_weights_from_disk, POST /update_weights_from_tensor,
  POST /get_weights_by_name, GET /health, GET /get_model_info, GET /get_server_info.

Tokens are computed by miles' own CPU model of the served checkpoint (weights rounded to the
--dtype, math in float32), one full forward per decode step over the running batch, so a run
against it is a real RL run. Like the real server it refuses at start what its kernels cannot
run (float32, rotary head sizes outside 64/128/256/512), and it dies at start with an error of
the caller's choosing when MILES_SGLANG_SIM_FAIL_AT_START is set (the failure tests).
MILES_SGLANG_SIM_HOLD_UPDATES names a file: while it exists, every weight update after the first
this process takes waits before landing (not in SGLang), so a test can kill the server at a
point where the run still needs it, instead of racing the run to its last step.
/update_weights_from_tensor unpickles its payload (SGLang's wire format for that endpoint);
only loopback clients reach it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import pickle
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from miles.models.config import ModelSpec
from miles.models.hf_io import hf_tensor_views, iter_checkpoint, load_hf_tensors
from miles.models.registry import build_model

VERSION = "0.5.17-sim"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser("sglang.launch_server (simulation)")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--base-gpu-id", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--mem-fraction-static", type=float, default=0.9)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--context-length", type=int, default=4096)
    ap.add_argument("--max-running-requests", type=int, default=128)
    ap.add_argument("--skip-tokenizer-init", action="store_true")
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--enable-return-routed-experts", action="store_true")
    args, _ = ap.parse_known_args(argv)  # backend flags (--attention-backend ...) mean nothing here
    return args


def die(msg: str) -> None:
    """Fail at start the way the real server does: a traceback whose last line is the cause."""
    print("Traceback (most recent call last):\n  File \"sglang/srt/managers/scheduler.py\", line 1, in "
          f"run_scheduler_process\n{msg}", flush=True)
    sys.exit(1)


@dataclass
class Req:
    rid: str
    prompt: list[int]
    sp: dict[str, Any]
    routed: bool
    done: asyncio.Future[dict[str, Any]]
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)  # [rows, L_moe, k] per step
    gen: torch.Generator | None = None
    abort: str = ""
    t0: float = field(default_factory=time.monotonic)


class SimServer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.spec = ModelSpec.from_dir(args.model_path)
        self.dtype = _DTYPES.get(args.dtype, torch.bfloat16)
        self.model = build_model(self.spec).eval()
        self.load(iter_checkpoint(args.model_path))
        self.model_path = args.model_path
        self.version = args.weight_version
        self.queue: list[Req] = []
        self.paused = False
        self.held = 0  # requests the pause holds before the scheduler (tests wait on it)
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.wake = asyncio.Event()
        self.step_lock = asyncio.Lock()  # weight updates land between two steps
        self.updates = 0  # weight updates received (MILES_SGLANG_SIM_HOLD_UPDATES)

    def load(self, named: Any) -> None:
        # the served dtype's rounding, float32 math (CPU)
        load_hf_tensors(self.model, ((k, v.to(self.dtype).float()) for k, v in named))

    # ---- scheduler ----------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.queue and not self.paused:
                async with self.step_lock:
                    batch = [r for r in self.queue if not r.abort][: self.args.max_running_requests]
                    for r in [r for r in self.queue if r.abort]:
                        self.finish(r, {"type": "abort", "message": r.abort})
                    if batch:
                        await asyncio.to_thread(self.step, batch)
                        for r in batch:
                            self.maybe_finish(r)
                await asyncio.sleep(0)  # let control calls (pause, abort, updates) in between steps

    @torch.no_grad()
    def step(self, batch: list[Req]) -> None:
        seqs = [r.prompt + r.out for r in batch]
        lens = torch.tensor([len(s) for s in seqs])
        ids = torch.zeros(len(seqs), int(lens.max()), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        moe = bool(self.spec.moe_layers)
        out = self.model(ids, logits_at=lens - 1, return_routed_experts=moe)
        logits = out.logits[:, 0].float()
        for i, r in enumerate(batch):
            if moe and out.routed_experts is not None:
                rows = out.routed_experts[i, : lens[i]] if not r.out else out.routed_experts[i, lens[i] - 1: lens[i]]
                r.routes.append(rows.to(torch.int32))
            t = float(r.sp.get("temperature", 1.0))
            lp = torch.log_softmax(logits[i] / (t if t > 0 else 1.0), -1)
            if t <= 0:
                tok = int(lp.argmax())
            else:
                p = lp.exp()
                k = int(r.sp.get("top_k", -1))
                if 0 < k < p.numel():
                    p[p < p.topk(k).values[-1]] = 0
                top_p = float(r.sp.get("top_p", 1.0))
                if top_p < 1:
                    sp, si = p.sort(descending=True)
                    drop = sp.cumsum(0) - sp > top_p
                    p[si[drop]] = 0
                tok = int(torch.multinomial(p / p.sum(), 1, generator=r.gen))
            r.out.append(tok)
            r.logprobs.append(float(lp[tok]))

    def maybe_finish(self, r: Req) -> None:
        # as SGLang 0.5.17 (Req._check_token_based_finish): ignore_eos turns off every token-based
        # stop, the caller's stop_token_ids included
        if not r.sp.get("ignore_eos") and r.out[-1] in (r.sp.get("stop_token_ids") or []):
            self.finish(r, {"type": "stop", "matched": r.out[-1]})
        elif len(r.out) >= int(r.sp["max_new_tokens"]) or len(r.prompt) + len(r.out) >= self.args.context_length:
            self.finish(r, {"type": "length", "length": len(r.out)})

    def finish(self, r: Req, reason: dict[str, Any]) -> None:
        if r in self.queue:
            self.queue.remove(r)
        meta: dict[str, Any] = {
            "id": r.rid, "finish_reason": reason, "prompt_tokens": len(r.prompt), "weight_version": self.version,
            "num_retractions": 0, "input_token_logprobs": [],
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(r.logprobs, r.out, strict=True)],
            "output_token_logprobs_length": len(r.out), "reasoning_tokens": 0, "completion_tokens": len(r.out),
            "cached_tokens": 0, "cached_tokens_details": None,
        }
        # An aborted request answers without routed_experts: what SGLang 0.5.17 did on the H200
        # (requests aborted by /pause_generation while a weight version was committed).
        if r.routed and self.args.enable_return_routed_experts and reason.get("type") != "abort":
            moe = torch.cat(r.routes) if r.routes else torch.zeros(0, len(self.spec.moe_layers),
                                                                   self.spec.num_experts_per_tok, dtype=torch.int32)
            # one row per decoder layer, as the server captures them (dense layers: zeros)
            full = torch.zeros(moe.shape[0], self.spec.num_layers, moe.shape[2], dtype=torch.int32)
            full[:, list(self.spec.moe_layers)] = moe
            meta["routed_experts"] = base64.b64encode(full.numpy().astype("<i4").tobytes()).decode()
        meta.update(dp_rank=None, e2e_latency=time.monotonic() - r.t0, response_sent_to_client_ts=time.time())
        if not r.done.done():
            r.done.set_result({"output_ids": list(r.out), "meta_info": meta})

    # ---- HTTP ---------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.held += 1
        try:
            while self.paused:  # the tokenizer manager holds new requests while paused
                await self.unpaused.wait()
        finally:
            self.held -= 1
        sp = dict(body.get("sampling_params") or {})
        if int(sp.get("max_new_tokens") or 0) < 1:
            return web.json_response({"error": {"message": "max_new_tokens must be positive"}}, status=400)
        seed = sp.get("sampling_seed")
        gen = torch.Generator().manual_seed(int(seed)) if seed is not None else None
        r = Req(str(body.get("rid") or os.urandom(8).hex()), [int(t) for t in body["input_ids"]], sp,
                bool(body.get("return_routed_experts")), asyncio.get_running_loop().create_future(), gen=gen)
        self.queue.append(r)
        self.wake.set()
        return web.json_response(await r.done)

    async def pause(self, request: web.Request) -> web.Response:
        mode = (await request.json()).get("mode", "abort")
        self.paused = True
        self.unpaused.clear()
        async with self.step_lock:  # after the running step
            if mode == "abort":
                for r in list(self.queue):
                    self.finish(r, {"type": "abort", "message": "Abort by pause_generation."})
        return web.json_response({"success": True})

    async def resume(self, request: web.Request) -> web.Response:
        self.paused = False
        self.unpaused.set()
        self.wake.set()
        return web.json_response({"success": True})

    async def abort_request(self, request: web.Request) -> web.Response:
        rid = (await request.json()).get("rid")
        for r in self.queue:
            if r.rid == rid:
                r.abort = "Abort in waiting queue" if not r.out else "Abort running request"
        self.wake.set()
        return web.Response(text="")

    async def hold_update(self) -> None:
        hold = os.environ.get("MILES_SGLANG_SIM_HOLD_UPDATES")
        self.updates += 1
        while hold and self.updates > 1 and os.path.exists(hold):
            await asyncio.sleep(0.05)

    async def update_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        await self.hold_update()
        async with self.step_lock:
            try:
                await asyncio.to_thread(self.load, iter_checkpoint(body["model_path"]))
            except Exception as exc:  # noqa: BLE001 - reported as the server does
                return web.json_response({"success": False, "message": f"Failed to update weights: {exc}"})
            self.model_path = body["model_path"]
            if body.get("weight_version") is not None:
                self.version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def update_tensor(self, request: web.Request) -> web.Response:
        body = await request.json()
        await self.hold_update()
        import torch.multiprocessing  # noqa: F401 - registers torch's rebuild functions

        async with self.step_lock:
            try:
                named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))  # noqa: S301
                await asyncio.to_thread(self.load_partial, named)
            except Exception as exc:  # noqa: BLE001
                return web.json_response({"success": False, "message": f"Failed to update weights: {exc}"})
            if body.get("weight_version") is not None:
                self.version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    def load_partial(self, named: list[tuple[str, torch.Tensor]]) -> None:
        views = hf_tensor_views(self.model)
        for name, t in named:
            views[name].copy_(t.to(self.dtype).float())

    async def weights_by_name(self, request: web.Request) -> web.Response:
        body = await request.json()
        t = hf_tensor_views(self.model)[body["name"]]
        n = int(body.get("truncate_size") or t.shape[0])
        return web.json_response(t[:n].float().tolist())

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.args.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.version,
            "model_type": self.spec.hf_config.get("model_type"),
            "architectures": self.spec.hf_config.get("architectures")})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({**{k: v for k, v in vars(self.args).items()}, "version": VERSION,
                                  "simulation": "miles tests/sglang_sim: not SGLang",
                                  # the simulation's own state, for tests to wait on (not in SGLang)
                                  "sim_held_requests": self.held,
                                  "sim_output_tokens": [len(r.out) for r in self.queue if not r.abort]})

    async def flush(self, request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")


def app(server: SimServer) -> web.Application:
    a = web.Application(client_max_size=1 << 30)
    a.add_routes([
        web.post("/generate", server.generate), web.put("/generate", server.generate),
        web.post("/pause_generation", server.pause), web.post("/continue_generation", server.resume),
        web.post("/abort_request", server.abort_request), web.post("/flush_cache", server.flush),
        web.get("/flush_cache", server.flush), web.post("/update_weights_from_disk", server.update_disk),
        web.post("/update_weights_from_tensor", server.update_tensor),
        web.post("/get_weights_by_name", server.weights_by_name), web.get("/health", server.health),
        web.get("/get_model_info", server.model_info), web.get("/model_info", server.model_info),
        web.get("/get_server_info", server.server_info),
    ])
    return a


async def main(argv: list[str]) -> None:
    args = parse_args(argv)
    fail = os.environ.get("MILES_SGLANG_SIM_FAIL_AT_START")
    if fail:
        die(fail)
    if args.dtype == "float32":
        die("RuntimeError: rmsnorm: no kernel for dtype float32 (simulated: SGLang's rmsnorm has none)")
    spec = ModelSpec.from_dir(args.model_path)
    if "kv_lora_rank" not in spec.hf_config and spec.head_dim not in (64, 128, 256, 512):
        die("AssertionError: save kv cache is not supported for fallback_rotary_embedding.")
    torch.set_num_threads(1)
    server = SimServer(args)
    runner = web.AppRunner(app(server))
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    print(f"simulated SGLang {VERSION} serving {args.model_path} on {args.host}:{args.port}", flush=True)
    await server.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
