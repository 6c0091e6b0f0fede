"""`bench/engine.py --sglang` on CPU: the workload both engines run (bench/engine_cases.py), the
SGLang server it launches (bench/engine_sglang.py), and SGLangEngine keeping a whole batch in
flight. The SGLang throughput itself is measured on the H200 only (bench/gpu/engine_vs_sglang.sh);
the loopback server here speaks SGLang 0.5.17's HTTP wire (/generate, /flush_cache, ...) to count
requests in flight and cache flushes, and times nothing."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from aiohttp import web

from miles.core.ports import group_port
from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateResult
from miles.engines.sglang import SGLangEngine
from miles.engines.sglang_server import launch_args
from miles.engines.sglang_wire import generate_payload
from miles.engines.torch_engine import TorchEngine
from miles.models.config import ModelSpec
from miles.models.hf_io import save_model
from miles.models.presets import tiny_config
from miles.models.registry import build_model

pytestmark = pytest.mark.timeout(60)
BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str, file: str = "") -> ModuleType:
    """A bench module by file, under the name its siblings import it by (bench/ is not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{file or name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


cases = _load("engine_cases")
engine_sglang = _load("engine_sglang")
bench = _load("bench_engine", "engine")


def _requests(case: Any, vocab: int) -> list[Any]:
    ids = [p.tolist() for p in cases.prompts_for(case, vocab)]
    return cases.requests_for(ids, cases.sampling_for(case))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_case_runs_to_its_token_count_without_stops(device: str) -> None:
    for name, case in cases.CASES[device].items():
        vocab = cases.MODELS[device]["dense"]["vocab_size"]
        reqs = _requests(case, vocab)
        assert len(reqs) == case.batch, name
        assert len({r.request_id for r in reqs}) == case.batch  # fresh ids: SGLang keys requests by rid
        for i, r in enumerate(reqs):
            assert len(r.input_ids) == case.prompt and all(0 <= t < vocab for t in r.input_ids)
            s = r.sampling
            assert s.max_new_tokens == case.new and s.stop_token_ids == [] and s.temperature == case.temperature
            assert s.seed == (i if case.seeded else None)
            sp = generate_payload(r)["sampling_params"]
            assert sp["ignore_eos"] is True and "stop_token_ids" not in sp and sp["max_new_tokens"] == case.new
        again = _requests(case, vocab)  # the next run sends the same prompts under new request ids
        assert [r.input_ids for r in again] == [r.input_ids for r in reqs]
        assert not {r.request_id for r in again} & {r.request_id for r in reqs}


def test_grouped_case_is_eight_groups_of_eight_identical_prompts() -> None:
    case = cases.CASES["cuda"]["group8x8"]
    ids = [r.input_ids for r in _requests(case, cases.MODELS["cuda"]["dense"]["vocab_size"])]
    assert (case.batch, case.prompt, case.new) == (64, 1024, 64)
    groups = [ids[g * 8:(g + 1) * 8] for g in range(8)]
    for g in groups:
        assert all(p == g[0] for p in g)  # a group's n samples share one prompt, consecutive as sent
    assert len({tuple(g[0]) for g in groups}) == 8  # and the groups differ
    for name in ("b32", "b128", "b256"):
        plain = [tuple(r.input_ids) for r in _requests(cases.CASES["cuda"][name], 32000)]
        assert len(set(plain)) == len(plain), name  # no shared prompts in the decode-heavy cases


def test_sglang_server_flags_cover_every_case(tmp_path: Path) -> None:
    cuda = list(cases.CASES["cuda"].values())
    cfg = engine_sglang.sglang_config(tmp_path / "ckpt", cuda, 31000, tmp_path / "stage", python="python3")
    args = launch_args(cfg, str(tmp_path / "ckpt"), 0, cfg.max_seq_len)
    joined = " ".join(args)
    assert "--disable-cuda-graph" not in args  # CUDA graphs on, as in issue 21's SGLang numbers
    for part in ("--cuda-graph-max-bs 256", "--max-running-requests 256", "--attention-backend triton",
                 "--sampling-backend pytorch", "--skip-tokenizer-init", "--port 31000", "--dtype bfloat16"):
        assert part in joined, part
    ctx = int(args[args.index("--context-length") + 1])
    assert ctx >= max(c.prompt + c.new for c in cuda)
    assert args[0] == "python3"


def test_check_results_refuses_a_run_that_stopped_early() -> None:
    case = cases.Case(2, 1, 4, 3)
    full = [GenerateResult(f"r{i}", [1, 2, 3], [0.0] * 3, "length", [0] * 3, 4, 0) for i in range(2)]
    cases.check_results(case, full, "x")
    short = [full[0], GenerateResult("r1", [1, 2], [0.0] * 2, "stop", [0] * 2, 4, 0)]
    with pytest.raises(RuntimeError, match="1 of 2 requests did not generate 3 tokens"):
        cases.check_results(case, short, "x")
    with pytest.raises(RuntimeError, match="1 results for 2"):
        cases.check_results(case, full[:1], "x")


async def test_torch_engine_generates_every_token_of_a_grouped_case() -> None:
    cfg = tiny_config("qwen3", vocab_size=97, initializer_range=0.15)
    model = build_model(ModelSpec.from_hf(cfg), seed=0)
    case = cases.Case(2, 4, 24, 8)
    engine = TorchEngine(model, EngineConfig(max_batch_size=case.batch, max_seq_len=64, kv_budget_tokens=0))
    try:
        reqs = _requests(case, 97)
        res = await asyncio.gather(*(engine.generate(r) for r in reqs))
    finally:
        await engine.close()
    cases.check_results(case, res, "engine")
    # greedy: a group's samples, same prompt, same output
    assert all(res[g * 4 + j].output_ids == res[g * 4].output_ids for g in range(2) for j in range(4))


class _SGLangWire:
    """A loopback HTTP server answering /health, /get_model_info and /generate in SGLang 0.5.17's
    format; each /generate is held until `target` are in flight (or 3 s), to count concurrency."""

    def __init__(self, target: int) -> None:
        self.target, self.inflight, self.peak = target, 0, 0
        self.all_in = asyncio.Event()
        self.flushes, self.refuse_flush = 0, False
        self.batches: list[dict[str, Any]] = []  # bodies of batched /generate calls
        self.answer_only: int | None = None  # answer a batch with only this many results

    async def flush(self, _: web.Request) -> web.Response:
        if self.refuse_flush:  # what 0.5.17 answers while requests are still running
            return web.Response(status=400, text="Cache not flushed because there are pending requests.")
        self.flushes += 1
        return web.Response(text="Cache flushed.")

    @staticmethod
    async def server_info(_: web.Request) -> web.Response:
        return web.json_response({"version": "wire", "cuda_graph_max_bs": 8, "tokenizer_path": "x"})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        if self.inflight >= self.target:
            self.all_in.set()
        try:
            await asyncio.wait_for(self.all_in.wait(), 3.0)
        except TimeoutError:
            pass
        self.inflight -= 1
        if body["input_ids"] and isinstance(body["input_ids"][0], list):  # SGLang's batch form
            self.batches.append(body)
            return web.json_response([self._one(ids, sp) for ids, sp in
                                      zip(body["input_ids"], body["sampling_params"], strict=True)][:self.answer_only])
        return web.json_response(self._one(body["input_ids"], body["sampling_params"]))

    @staticmethod
    def _one(ids: list[int], sp: dict[str, Any]) -> dict[str, Any]:
        out = [(len(ids) + i) % 7 for i in range(sp["max_new_tokens"])]
        meta = {"output_token_logprobs": [[-0.5, t, None] for t in out], "finish_reason": {"type": "length"},
                "weight_version": "default", "prompt_tokens": len(ids), "cached_tokens": 0}
        return {"output_ids": out, "meta_info": meta}

    @staticmethod
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    @staticmethod
    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": "default"})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/flush_cache", self.flush)
        app.router.add_get("/get_server_info", self.server_info)
        return app


async def _serve(wire: _SGLangWire) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(wire.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


def _checkpoint(path: Path) -> Path:
    save_model(build_model(ModelSpec.from_hf(tiny_config("qwen3", vocab_size=97)), seed=0).to(torch.bfloat16), path)
    return path


async def test_sglang_engine_keeps_more_than_100_requests_in_flight(tmp_path: Path) -> None:
    """aiohttp's default pool (100 connections) would cap a batch of 150 at 100 on the client side."""
    wire = _SGLangWire(150)
    runner, port = await _serve(wire)
    cfg = EngineConfig(type="sglang", dtype="bfloat16", max_batch_size=150,
                       sglang_url=f"http://127.0.0.1:{port}", sglang_model_path=str(_checkpoint(tmp_path / "ckpt")),
                       sglang_stage_dir=str(tmp_path / "stage"))
    engine = SGLangEngine(cfg)
    case = cases.Case(150, 1, 8, 4)
    try:
        res = await asyncio.gather(*(engine.generate(r) for r in _requests(case, 97)))
    finally:
        await engine.close()
        await runner.cleanup()
    assert wire.peak == 150
    cases.check_results(case, res, "sglang")


def test_sglang_run_flushes_before_each_run_and_stops_at_a_failure(tmp_path: Path) -> None:
    """The bench's SGLang driver on its own event loop, as bench/engine.py runs it between the
    torch engine's runs: flush (untimed), then the whole batch; a refused flush ends that case."""
    wire = _SGLangWire(6)
    wire_loop = asyncio.new_event_loop()  # the server's loop, run on demand next to the driver's
    runner, port = wire_loop.run_until_complete(_serve(wire))
    cfg = engine_sglang.sglang_config(_checkpoint(tmp_path / "ckpt"), [cases.Case(3, 2, 8, 4)], port,
                                      tmp_path / "stage")
    cfg.sglang_url = f"http://127.0.0.1:{port}"  # the loopback server instead of a launched one
    t = threading.Thread(target=wire_loop.run_forever, daemon=True)
    t.start()
    server = engine_sglang.SGLangServerRun(cfg)
    try:
        server.start()
        assert server.info == {"version": "wire", "cuda_graph_max_bs": 8}
        case = cases.Case(3, 2, 8, 4)
        run = server.run(case, [p.tolist() for p in cases.prompts_for(case, 97)])
        for i in range(2):
            run.prepare()
            run()
            assert not run.failed and wire.flushes == i + 1 and wire.peak == 6
        wire.refuse_flush = True
        run.prepare()
        assert "HTTP 400" in run.failed
        run()  # a failed case sends nothing more
        assert wire.peak == 6 and wire.flushes == 2
    finally:
        server.close()
        wire_loop.call_soon_threadsafe(wire_loop.stop)
        t.join(5)
        wire_loop.run_until_complete(runner.cleanup())
        wire_loop.close()


def test_sglang_that_cannot_start_keeps_the_torch_engine_numbers(tmp_path: Path) -> None:
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here: its server would start")
    port = group_port()  # a free port for the server that never comes up
    args = bench.parse_args(["--models", "dense", "--cases", "b8", "--hf", "", "--repeats", "1", "--sglang",
                             "--sglang-dir", str(tmp_path), "--sglang-port", str(port), "--sglang-start-s", "50",
                             "--out", str(tmp_path / "out.json")])
    out: dict[str, Any] = {}
    bench.bench_model("dense", args, out)
    assert "exited with code" in out["dense_sglang_error"]  # python -m sglang.launch_server: no sglang here
    assert out["cpu_dense_b8_engine_tok_s"] > 0 and "cpu_dense_b8_sglang_tok_s" not in out
    assert not (tmp_path / "dense" / "server.pid").exists()  # the server was stopped (closed)
    assert "cpu_dense_b8_engine_tok_s" in (tmp_path / "out.json").read_text()


def test_engine_set_options_are_checked_against_the_engine_config() -> None:
    got = bench.parse_engine_set(["compile_decode=false", "max_batch_size=4", "kv_layout=paged"])
    assert got == {"compile_decode": False, "max_batch_size": 4, "kv_layout": "paged"}
    EngineConfig(**got)  # what the bench passes on
    for bad, says in (("no_such_option=1", "EngineConfig's fields"), ("overlap_decode=yes", "true or false"),
                      ("max_batch_size=many", "of type int"), ("compile_decode", "KEY=VALUE")):
        with pytest.raises(SystemExit, match=says):
            bench.parse_engine_set([bad])


def test_batched_payload_is_each_request_as_sent_alone_in_lists() -> None:
    case = cases.CASES["cuda"]["b128_t1"]
    assert (case.batch, case.new, case.temperature) == (128, 128, 1.0)
    reqs = _requests(cases.Case(3, 1, 5, 4, temperature=1.0), 97)
    body = engine_sglang.batch_payload(reqs)
    alone = [generate_payload(r) for r in reqs]
    assert body["rid"] == [a["rid"] for a in alone] and body["input_ids"] == [a["input_ids"] for a in alone]
    assert body["sampling_params"] == [a["sampling_params"] for a in alone]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1 and body["stream"] is False
    with pytest.raises(ValueError, match="at least one"):
        engine_sglang.batch_payload([])


def test_sglang_batched_run_sends_one_generate_for_the_batch(tmp_path: Path) -> None:
    """Both ways of driving SGLang over the loopback wire: the batched run sends the case as one
    /generate (lists, in request order) and parses every result; the per-request run sends B."""
    wire = _SGLangWire(6)
    wire_loop = asyncio.new_event_loop()
    runner, port = wire_loop.run_until_complete(_serve(wire))
    case = cases.Case(3, 2, 8, 4)
    cfg = engine_sglang.sglang_config(_checkpoint(tmp_path / "ckpt"), [case], port, tmp_path / "stage")
    cfg.sglang_url = f"http://127.0.0.1:{port}"
    t = threading.Thread(target=wire_loop.run_forever, daemon=True)
    t.start()
    server = engine_sglang.SGLangServerRun(cfg)
    try:
        server.start()
        ids = [p.tolist() for p in cases.prompts_for(case, 97)]
        batched, single = server.run(case, ids, batched=True), server.run(case, ids)
        for run in (batched, single, batched):
            run.prepare()
            run()
            assert not run.failed, run.failed
        assert len(wire.batches) == 2 and wire.peak == 6  # the single run's 6 requests were in flight at once
        assert [len(b["input_ids"]) for b in wire.batches] == [6, 6]
        assert wire.batches[0]["input_ids"] == ids and len(set(wire.batches[0]["rid"])) == 6
        assert not set(wire.batches[0]["rid"]) & set(wire.batches[1]["rid"])  # fresh ids each run
        wire.answer_only = 2  # a server answering 2 results for a batch of 6: refused, the case stops
        batched()
        assert "expected a list of 6 results, got a list of 2" in batched.failed
    finally:
        server.close()
        wire_loop.call_soon_threadsafe(wire_loop.stop)
        t.join(5)
        wire_loop.run_until_complete(runner.cleanup())
        wire_loop.close()


def test_sglang_modes_and_the_table_columns(capsys: pytest.CaptureFixture[str]) -> None:
    args = bench.parse_args(["--device", "cuda", "--cases", "b128_t1,b256", "--sglang-modes", "batched"])
    assert args.sglang_modes == ["batched"] and args.cases == ["b128_t1", "b256"]
    assert bench.parse_args([]).sglang_modes == ["requests", "batched"]
    with pytest.raises(SystemExit, match="--sglang-modes"):
        bench.parse_args(["--sglang-modes", "batch"])
    case = cases.CASES["cuda"]["b256"]
    assert (case.batch, case.new) == (256, 512)
    out: dict[str, Any] = {}
    bench.report("dense", "b256", case, {"engine": 200.0, "sglang": 100.0, "sglang_batched": 250.0}, [[1.0]],
                 out, "cuda")
    row = capsys.readouterr().out.split()
    assert row[:5] == ["dense", "b256", "256", "128", "512"]
    assert ["100.0", "2.00", "250.0", "0.80"] == row[9:13]  # per request, engine / it; batched, engine / it
    assert out["gpu_dense_b256_vs_sglang"] == 2.0 and out["gpu_dense_b256_vs_sglang_batched"] == 0.8
    assert out["gpu_dense_b256_sglang_batched_tok_s"] == 250.0
