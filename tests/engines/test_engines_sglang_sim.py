"""SGLangEngine's launched path on CPU, against a server that speaks SGLang 0.5.17's HTTP wire:
tests/sglang_sim (a simulation of SGLang's wire computing with miles' own CPU model; not SGLang),
launched by the engine itself through `engine.sglang_python` exactly as it launches the real one.
Covers start + warm-up, generate with routed experts, pause, commit (disk and in memory),
versions, restart after a crash, and a start failure that must not be restarted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from miles.core.errors import EngineStartError
from miles.core.ports import group_port
from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, GenerateResult, SamplingParams
from miles.engines.sglang import SGLangEngine
from miles.models.config import ModelSpec
from miles.models.hf_io import hf_tensor_views, save_model, tensor_checksum
from miles.models.presets import tiny_config
from miles.models.registry import build_model

pytestmark = pytest.mark.timeout(240)

SIM_PYTHON = Path(__file__).parents[1] / "sglang_sim" / "python"
RECORDED = json.loads((Path(__file__).parents[1] / "data" / "sglang_h200" / "responses.json").read_text())
SPEC = ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=128, head_dim=64))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    save_model(build_model(SPEC, seed=0), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def sim_config(ckpt: Path, tmp_path: Path, update: str = "disk", **kw: object) -> EngineConfig:
    return EngineConfig(type="sglang", sglang_model_path=str(ckpt), sglang_port=group_port(),
                        sglang_python=str(SIM_PYTHON), sglang_return_routed_experts=True,
                        sglang_stage_dir=str(tmp_path / "stage"), sglang_startup_timeout_s=120,
                        sglang_weight_update=update, max_seq_len=256, **kw)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def sim_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_SGLANG_SIM_PYTHON", sys.executable)


async def sim_until(eng: SGLangEngine, cond: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0) -> None:
    """Poll the simulated server's own state (its /get_server_info) until `cond` holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond(info := await eng._call("GET", "/get_server_info")):
        assert asyncio.get_running_loop().time() < deadline, info
        await asyncio.sleep(0.02)


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll the engine's own state until `cond` holds; fail naming `what` after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"no {what} within {timeout_s:g} s"
        await asyncio.sleep(0.05)


def req(n: int = 6, seed: int | None = 1, routed: bool = True, temperature: float = 1.0) -> GenerateRequest:
    return GenerateRequest([5, 9, 17, 33], SamplingParams(temperature=temperature, max_new_tokens=n, seed=seed),
                           return_routed_experts=routed)


async def test_simulated_wire_has_the_recorded_shape(ckpt: Path, tmp_path: Path) -> None:
    """The simulation answers /generate with the keys a real 0.5.17 server returned."""
    eng = SGLangEngine(sim_config(ckpt, tmp_path))
    try:
        await eng.start()
        from miles.engines.sglang_wire import generate_payload

        body = await eng._call("POST", "/generate", generate_payload(req()))
        real = RECORDED["generate"][0]["response"]
        assert list(body) == list(real)
        assert list(body["meta_info"]) == list(real["meta_info"])
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        assert isinstance(body["meta_info"]["weight_version"], str)
    finally:
        await eng.close()


@pytest.mark.parametrize("update", ["disk", "tensor"])
async def test_warm_up_pause_commit_versions(ckpt: Path, tmp_path: Path, update: str) -> None:
    eng = SGLangEngine(sim_config(ckpt, tmp_path, update))
    try:
        assert not eng.health().ok
        await eng.warm_up()  # up and answered a request before anything is sent
        h = eng.health()
        assert h.ok and h.version == 0 and h.weight_update == update
        res = await eng.generate(req())
        assert len(res.output_ids) == 6 and res.versions == [0] * 6 and all(lp <= 0 for lp in res.logprobs)
        assert res.routed_experts is not None and res.routed_experts.shape == (4 + 6, 2, 2)
        # pause(retract): long requests come back with their partial output, marked retracted
        long = [asyncio.create_task(eng.generate(req(200, seed=i))) for i in range(3)]
        await until(lambda: eng.stats()["running"] >= 3 and bool(eng._totals.requests), "3 running requests")
        await sim_until(eng, lambda info: len(info["sim_output_tokens"]) == 3 and min(info["sim_output_tokens"]) > 0)
        back = await eng.pause()  # the engine's own default: retract
        assert len(back) == 3 and all(r.retracted and r.finish_reason == "abort" for r in back)
        assert all(len(r.output_ids) < 200 for r in back)
        outs = await asyncio.wait_for(asyncio.gather(*long), 10)  # their callers got the same results
        assert sorted(len(r.output_ids) for r in outs) == sorted(len(r.output_ids) for r in back)
        # commit v1 (new weights) while paused; the next responses carry version 1 and the new weights
        new = hf_tensor_views(build_model(SPEC, seed=1))
        names = sorted(new)
        await eng.stage(1, {n: new[n] for n in names[: len(names) // 2]})
        await eng.stage(1, {n: new[n] for n in names[len(names) // 2:]})
        await eng.commit(1)
        await eng.resume()
        res1 = await eng.generate(req())
        assert res1.versions == [1] * 6 and eng.health().version == 1
        emb = "model.embed_tokens.weight"
        served = await eng.served_checksums([emb])
        assert served[emb] == tensor_checksum(new[emb].to(torch.bfloat16))
        assert eng.checksums()[emb] == served[emb]
    finally:
        await eng.close()


@pytest.mark.parametrize("update", ["disk", "tensor"])
async def test_crashed_server_is_restarted_on_the_committed_version(ckpt: Path, tmp_path: Path, update: str) -> None:
    eng = SGLangEngine(sim_config(ckpt, tmp_path, update))
    try:
        await eng.warm_up()
        new = hf_tensor_views(build_model(SPEC, seed=2))
        await eng.pause()
        await eng.stage(1, new)
        await eng.commit(1)
        await eng.resume()
        greedy = await eng.generate(req(seed=None, temperature=0.0))
        assert eng.server is not None and eng.server.pid is not None
        os.killpg(eng.server.pid, signal.SIGKILL)
        await until(lambda: not eng.health().ok, "lost server")
        await until(lambda: eng.health().ok, "restart by the watchdog", 120)  # no request needed
        h = eng.health()
        assert h.ok and h.restarts == 1 and h.version == 1 and eng.server.starts == 2
        again = await eng.generate(req(seed=None, temperature=0.0))
        assert again.versions == [1] * 6 and again.output_ids == greedy.output_ids  # v1's weights, not v0's
    finally:
        await eng.close()


async def test_start_failure_shows_the_server_error_and_is_not_restarted(
        ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_SGLANG_SIM_FAIL_AT_START", "AssertionError: simulated kernel refusal")
    eng = SGLangEngine(sim_config(ckpt, tmp_path))
    try:
        with pytest.raises(EngineStartError, match="AssertionError: simulated kernel refusal"):
            await eng.warm_up()
        for _ in range(3):  # later calls repeat the cause; nothing is started again
            with pytest.raises(EngineStartError, match="simulated kernel refusal"):
                await eng.generate(req())
        # nothing can start it again later: the watchdog starts only once a server has served
        assert eng._watchdog is None
        assert eng.server is not None and eng.server.starts == 1 and eng.server.restarts == 0
        assert not eng.health().ok and "simulated kernel refusal" in eng.health().fatal
    finally:
        await eng.close()


async def test_callers_see_retracted_on_what_they_receive(ckpt: Path, tmp_path: Path) -> None:
    """The engine actor encodes a result the moment its caller resumes; a pause('retract') must have
    marked it by then (it marked after: on the H100 every retracted request went out as a plain abort)."""
    from dataclasses import replace

    eng = SGLangEngine(sim_config(ckpt, tmp_path, "tensor"))
    try:
        await eng.warm_up()

        async def as_the_actor_sends(seed: int) -> GenerateResult:
            return replace(await eng.generate(req(200, seed=seed)))  # a copy as of that moment, as encoding

        sent = [asyncio.create_task(as_the_actor_sends(i)) for i in range(3)]
        await sim_until(eng, lambda info: len(info["sim_output_tokens"]) == 3 and min(info["sim_output_tokens"]) > 0)
        back = await eng.pause("retract")
        wire = await asyncio.wait_for(asyncio.gather(*sent), 10)
        assert len(back) == 3 and all(w.retracted and w.finish_reason == "abort" for w in wire), wire
        await eng.resume()
        plain = asyncio.create_task(as_the_actor_sends(7))  # an abort asked by its caller is not a retract
        await sim_until(eng, lambda info: len(info["sim_output_tokens"]) == 1 and min(info["sim_output_tokens"]) > 0)
        assert await eng.abort(next(iter(eng._inflight)))
        w = await asyncio.wait_for(plain, 10)
        assert w.finish_reason == "abort" and not w.retracted
    finally:
        await eng.close()


async def test_pause_drops_a_request_the_server_holds_unscheduled(ckpt: Path, tmp_path: Path) -> None:
    """A request that reaches the server after /pause_generation is held there until resume and
    never answers; pause() must not wait for it (it did: the trainer's pause timed out)."""
    eng = SGLangEngine(sim_config(ckpt, tmp_path))
    try:
        await eng.warm_up()
        await eng._call("POST", "/pause_generation", {"mode": "abort"})  # the server pauses first
        held = asyncio.create_task(eng.generate(req()))
        await sim_until(eng, lambda info: info["sim_held_requests"] == 1)  # the server holds it
        back = await asyncio.wait_for(eng.pause(), 20)
        res = await asyncio.wait_for(held, 5)
        assert [r.request_id for r in back] == [res.request_id]
        assert res.retracted and res.finish_reason == "abort" and res.output_ids == []
        await eng.resume()
        assert len((await eng.generate(req())).output_ids) == 6
    finally:
        await eng.close()


async def test_a_server_that_cannot_come_back_ends_the_engine(ckpt: Path, tmp_path: Path) -> None:
    """Restarts exhausted (here none allowed): the engine reports it through on_lost (the engine
    role then ends with it, and its supervisor stops the run with the cause), not a loop."""
    eng = SGLangEngine(sim_config(ckpt, tmp_path, sglang_max_restarts=0))
    lost: list[BaseException] = []
    eng.on_lost = lost.append
    try:
        await eng.warm_up()
        assert eng.server is not None and eng.server.pid is not None
        os.killpg(eng.server.pid, signal.SIGKILL)
        await until(lambda: bool(lost), "on_lost call")
        assert len(lost) == 1 and isinstance(lost[0], EngineStartError)
        assert "restarted 0 times" in str(lost[0]) and eng.server.starts == 1
        assert not eng.health().ok and eng.health().fatal
        with pytest.raises(EngineStartError):
            await eng.generate(req())
    finally:
        await eng.close()


async def test_a_dense_checkpoint_generates_with_routing_replay_on(tmp_path: Path) -> None:
    """trainer.routing_replay is on by default; a dense model routes nothing, so the engine must not
    ask SGLang for routed experts a server without --enable-return-routed-experts never sends
    (every Qwen2.5 GSM8K request failed that way on an H100, session 15)."""
    dense = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=128, head_dim=64))
    save_model(build_model(dense, seed=0), tmp_path / "dense")
    cfg = sim_config(tmp_path / "dense", tmp_path)
    cfg.sglang_return_routed_experts = False
    eng = SGLangEngine(cfg)
    try:
        await eng.start()
        res = await eng.generate(req(routed=True))
        assert len(res.output_ids) == 6 and res.routed_experts is None
    finally:
        await eng.close()


async def test_a_start_waits_for_the_port_then_fails_naming_the_option(ckpt: Path, tmp_path: Path) -> None:
    """A listener holds the port (as a crashed engine role's old server does while it shuts down):
    the start waits for it; released within engine.sglang_port_wait_s, the server starts; held
    past it, the start fails naming the option."""
    cfg = sim_config(ckpt, tmp_path, sglang_port_wait_s=30.0)
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", cfg.sglang_port))
    held.listen()
    eng = SGLangEngine(cfg)
    try:
        with structlog.testing.capture_logs() as logs:
            start = asyncio.create_task(eng.start())
            while not any(e["event"] == "sglang_port_in_use_waiting" for e in logs):  # noqa: ASYNC110
                assert not start.done(), "the start did not wait for the busy port"
                await asyncio.sleep(0.02)
        assert not start.done()  # still waiting on the port
        held.close()
        await asyncio.wait_for(start, 120)
        assert (await eng.generate(req())).output_ids
    finally:
        held.close()
        await eng.close()
    cfg = sim_config(ckpt, tmp_path, sglang_port_wait_s=0.5)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", cfg.sglang_port))
        busy.listen()
        eng = SGLangEngine(cfg)
        try:
            with pytest.raises(EngineStartError, match="sglang_port_wait_s"):
                await eng.start()
        finally:
            await eng.close()
