"""SGLangEngine on CPU: request building and response parsing against responses recorded from a
real SGLang 0.5.17 server on an H200 (tests/data/sglang_h200/), launcher arguments, config checks,
and the parts of stage/commit/pause that refuse bad input before any HTTP call. The live server
path (generate, pause, commit, restart) is exercised on the H200 by bench/gpu/sglang_h200.py."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from miles.core.config import from_dict, load_config
from miles.core.errors import ConfigError, EngineError, ProtocolError
from miles.core.schema import MilesConfig
from miles.core.schema.engine import EngineConfig
from miles.engines.base import GenerateRequest, SamplingParams
from miles.engines.sglang import SGLangEngine
from miles.engines.sglang_server import launch_args
from miles.engines.sglang_wire import (
    ModelFacts,
    decode_routed_experts,
    generate_payload,
    parse_generate,
)
from miles.models.config import ModelSpec
from miles.models.hf_io import hf_tensor_views, save_model
from miles.models.registry import build_model

DATA = json.loads((Path(__file__).parents[1] / "data" / "sglang_h200" / "responses.json").read_text())
FACTS = ModelFacts.from_config(DATA["model"])


def _request(rec: dict) -> GenerateRequest:
    body = rec["request"]
    sp = body["sampling_params"]
    s = SamplingParams(temperature=sp["temperature"], top_p=sp["top_p"], top_k=max(sp["top_k"], 0),
                       max_new_tokens=sp["max_new_tokens"], stop_token_ids=sp.get("stop_token_ids", []),
                       seed=sp.get("sampling_seed"))
    return GenerateRequest(body["input_ids"], s, return_routed_experts=body.get("return_routed_experts", False),
                           request_id=body["rid"])


def test_payload_rebuilt_equals_what_the_server_accepted() -> None:
    """The recorded requests, rebuilt, but for one field: they were recorded with ignore_eos on
    beside stop ids, which SGLang reads as "no token-based stop at all" (the stop ids ignored);
    a request with stop ids now turns ignore_eos off."""
    for rec in DATA["generate"]:
        want = copy.deepcopy(rec["request"])
        want["sampling_params"]["ignore_eos"] = not want["sampling_params"].get("stop_token_ids")
        assert generate_payload(_request(rec)) == want
    assert any(r["request"]["sampling_params"].get("stop_token_ids") for r in DATA["generate"])


def test_recorded_responses_parse_into_results() -> None:
    for rec in DATA["generate"]:
        req, body = _request(rec), rec["response"]
        res = parse_generate(body, req, FACTS)
        meta = body["meta_info"]
        assert res.output_ids == [r[1] for r in meta["output_token_logprobs"]] == body["output_ids"]
        assert len(res.logprobs) == len(res.output_ids) == meta["completion_tokens"]
        assert all(lp <= 0 for lp in res.logprobs)
        assert res.finish_reason == meta["finish_reason"]["type"]
        assert res.versions == [0] * len(res.output_ids)
        assert res.prompt_tokens == len(req.input_ids)
        assert res.routed_experts is not None and res.routed_experts.dtype == np.uint8
        # one row per token as the engine contract has it: SGLang's last row repeated for the last token
        assert res.routed_experts.shape == (len(req.input_ids) + len(res.output_ids), 4, 2)
        assert (res.routed_experts[-1] == res.routed_experts[-2]).all()
        assert int(res.routed_experts.max()) < 8
        # Two distinct experts per token and layer (top-k without repeats).
        assert (res.routed_experts[..., 0] != res.routed_experts[..., 1]).all()


def test_greedy_request_with_stop_ids_was_sent_and_honoured() -> None:
    rec = DATA["generate"][-1]
    assert rec["request"]["sampling_params"]["temperature"] == 0.0
    assert rec["request"]["sampling_params"]["stop_token_ids"] == [7, 11]
    res = parse_generate(rec["response"], _request(rec), FACTS)
    assert res.finish_reason == "length" and not {7, 11} & set(res.output_ids[:-1])


def test_bad_responses_raise_protocol_errors() -> None:
    rec = DATA["generate"][0]
    req = _request(rec)
    body = copy.deepcopy(rec["response"])
    body["output_ids"] = body["output_ids"][::-1]
    with pytest.raises(ProtocolError, match="disagree"):
        parse_generate(body, req, FACTS)
    body = copy.deepcopy(rec["response"])
    del body["meta_info"]["routed_experts"]
    with pytest.raises(ProtocolError, match="enable-return-routed-experts"):
        parse_generate(body, req, FACTS)
    body = copy.deepcopy(rec["response"])
    body["meta_info"]["weight_version"] = "latest"
    with pytest.raises(ProtocolError, match="weight_version"):
        parse_generate(body, req, FACTS)
    body = copy.deepcopy(rec["response"])
    body["meta_info"]["finish_reason"] = {"type": "exploded"}
    with pytest.raises(ProtocolError, match="finish_reason"):
        parse_generate(body, req, FACTS)


def test_routed_experts_keep_only_moe_layers_and_check_sizes() -> None:
    cfg = dict(DATA["model"], mlp_only_layers=[1])
    facts = ModelFacts.from_config(cfg)
    assert facts.moe_layers == (0, 2, 3)
    ids = np.arange(5 * 4 * 2, dtype="<i4").reshape(5, 4, 2) % 8
    b64 = base64.b64encode(ids.tobytes()).decode()
    got = decode_routed_experts(b64, 5, facts, "t")  # one row per decoder layer -> MoE layers kept
    assert got.shape == (5, 3, 2) and (got == ids[:, [0, 2, 3]]).all()
    with pytest.raises(ProtocolError, match="rows=6"):
        decode_routed_experts(b64, 6, facts, "t")


def test_config_checks_for_sglang() -> None:
    cfg = EngineConfig(type="sglang", sglang_model_path="/m")
    assert cfg.dtype == "bfloat16" and cfg.default_pause_mode == "retract"  # defaults that SGLang can run
    assert EngineConfig().dtype == "float32" and EngineConfig().default_pause_mode == "in_place"
    with pytest.raises(ConfigError, match="mem_fraction"):
        EngineConfig(type="sglang", sglang_url="http://h:1", sglang_mem_fraction=1.5)
    with pytest.raises(ConfigError, match="removed.*sync.pause_mode"):
        load_config(MilesConfig, None, ["engine.pause_mode=retract"])
    with pytest.raises(ConfigError, match="removed.*sync.pause_mode"):
        from_dict(MilesConfig, {"engine": {"pause_mode": "retract"}})


def test_each_engine_gets_its_own_port() -> None:
    cfg = EngineConfig(type="sglang", sglang_port=31000, sglang_tp=2, sglang_placement="spread")
    e0, e1 = cfg.for_engine(0), cfg.for_engine(1)
    assert (e0.sglang_port, e1.sglang_port) == (31000, 31001)
    assert (e0.sglang_base_gpu, e1.sglang_base_gpu) == (0, 2)
    assert "--base-gpu-id 2" in " ".join(launch_args(e1, "/m", 0, 64))


@pytest.fixture
def engine(tmp_path: Path) -> SGLangEngine:
    model = build_model(ModelSpec.from_hf(DATA["model"]), seed=0)
    save_model(model.to(torch.bfloat16), tmp_path / "ckpt")
    cfg = EngineConfig(type="sglang", dtype="bfloat16", sglang_model_path=str(tmp_path / "ckpt"),
                       sglang_return_routed_experts=True, sglang_port=30123,
                       sglang_stage_dir=str(tmp_path / "stage"), sglang_extra_args=["--disable-cuda-graph"])
    return SGLangEngine(cfg)


def test_launch_args(engine: SGLangEngine) -> None:
    args = launch_args(engine.cfg, engine.model_path, 3, engine.max_seq_len)
    assert args[1:3] == ["-m", "sglang.launch_server"]
    joined = " ".join(args)
    for part in ("--port 30123", "--skip-tokenizer-init", "--weight-version 3", "--enable-return-routed-experts",
                 "--dtype bfloat16", f"--model-path {engine.model_path}", "--context-length 4096"):
        assert part in joined
    assert args[-1] == "--disable-cuda-graph"


async def test_stage_and_commit_refuse_bad_input_before_any_http(engine: SGLangEngine) -> None:
    hf = hf_tensor_views(build_model(ModelSpec.from_hf(DATA["model"]), seed=1))
    name = "model.embed_tokens.weight"
    with pytest.raises(EngineError, match="unknown tensor"):
        await engine.stage(1, {"model.nope.weight": hf[name]})
    with pytest.raises(EngineError, match="shape"):
        await engine.stage(1, {name: hf[name][:3]})
    assert await engine.stage(1, {name: hf[name]}) == 1
    with pytest.raises(EngineError, match="still staged"):
        await engine.stage(2, {name: hf[name]})
    with pytest.raises(EngineError, match="tensors not staged"):
        await engine.commit(1)
    shard = next(engine.stage_root.glob("v1.*/bucket-*.safetensors"))
    assert shard.is_file()
    await engine.abort_version(1)
    assert not list(engine.stage_root.glob("v1.*"))
    with pytest.raises(EngineError, match="nothing staged"):
        await engine.commit(1)
    with pytest.raises(EngineError, match="in_place"):
        await engine.pause("in_place")  # the runtime guard under the launch check
    with pytest.raises(EngineError, match="vocabulary"):
        await engine.generate(GenerateRequest([DATA["model"]["vocab_size"]]))
    assert set(engine.checksums()) == set(hf)
    await engine.close()
    assert not asyncio.all_tasks() - {asyncio.current_task()}


def test_an_aborted_response_may_come_without_routing() -> None:
    """SGLang 0.5.17 on the H200 answered requests aborted by /pause_generation without
    routed_experts; the partial output is kept (the retract continues it) instead of failing."""
    rec = DATA["generate"][0]
    req = _request(rec)
    body = copy.deepcopy(rec["response"])
    del body["meta_info"]["routed_experts"]
    body["meta_info"]["finish_reason"] = {"type": "abort", "message": "paused"}
    res = parse_generate(body, req, FACTS)
    assert res.finish_reason == "abort" and res.routed_experts is None
    assert res.output_ids == body["output_ids"]
