"""SGLang 0.5.17 HTTP wire format: `/generate` request bodies and response parsing.

Relies on these fields of `sglang.srt.managers.io_struct.GenerateReqInput` (0.5.17):
`input_ids`, `sampling_params`, `rid`, `return_logprob`, `logprob_start_len`,
`return_routed_experts`; and on the response's `output_ids` plus `meta_info` keys
`output_token_logprobs` ([logprob, token_id, text|null] per output token),
`finish_reason` ({"type": "length"|"stop"|"abort", ...} or null), `weight_version`
(string), `prompt_tokens`, `cached_tokens`, `routed_experts` (base64 of int32).

Logprobs: SGLang's default sampler returns log(softmax(logits / temperature)) before
top-p/top-k truncation, and greedy (temperature 0) is run as temperature 1 with top_k 1,
which is miles' definition (engines/base.py). Do not set SGLANG_RETURN_ORIGINAL_LOGPROB.

Routed experts: SGLang returns int32 ids of shape [prompt + completion - 1, layers, k]:
the last sampled token is never fed forward, so its routing does not exist. The engine
contract (engines/base.py, what the rollout's session store takes) is one row per fed
token, prompt + completion, like the embedded engine whose flush step feeds the last token;
so a finished request's last row is repeated for it. That row routes only the last token's
own position in the trainer's replay, whose output no loss reads, and under causal attention
no earlier position sees it. An aborted request keeps SGLang's shape (the contract's "one
less when aborted").
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from miles.core.errors import ConfigError, EngineError, ProtocolError
from miles.engines.base import FinishReason, GenerateRequest, GenerateResult
from miles.models.config import ModelSpec
from miles.models.moe import expert_id_dtype

_FINISH: dict[str, FinishReason] = {"length": "length", "stop": "stop", "abort": "abort"}


@dataclass(frozen=True)
class ModelFacts:
    """What the client needs from the served checkpoint's config.json."""

    vocab_size: int
    num_layers: int
    num_experts: int  # 0 = dense
    top_k: int
    moe_layers: tuple[int, ...]
    max_positions: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any], where: str = "config.json") -> ModelFacts:
        try:
            n_layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{where}: missing or bad num_hidden_layers/vocab_size ({exc})") from exc
        if cfg.get("model_type") in ("glm4_moe", "deepseek_v3") or "n_routed_experts" in cfg:
            # DeepSeek-style layout (n_routed_experts, first_k_dense_replace): miles' own parse
            try:
                spec = ModelSpec.from_hf(cfg)
            except ConfigError as exc:
                raise EngineError(f"{where}: {exc}") from exc
            return cls(vocab, n_layers, spec.num_experts, spec.num_experts_per_tok, spec.moe_layers,
                       spec.max_position_embeddings)
        n_exp = int(cfg.get("num_experts") or 0)
        k = int(cfg.get("num_experts_per_tok") or 0)
        moe: tuple[int, ...] = ()
        if n_exp:
            step = int(cfg.get("decoder_sparse_step") or 1)
            dense = set(cfg.get("mlp_only_layers") or [])
            moe = tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
        return cls(vocab, n_layers, n_exp, k, moe, int(cfg.get("max_position_embeddings") or 1 << 30))

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelFacts:
        f = Path(path) / "config.json"
        if not f.is_file():
            raise EngineError(f"{str(f)!r} does not exist; sglang_model_path must be an HF checkpoint directory")
        return cls.from_config(json.loads(f.read_text()), str(f))


def sampling_payload(req: GenerateRequest) -> dict[str, Any]:
    s = req.sampling
    out: dict[str, Any] = {
        "temperature": float(s.temperature),
        "top_p": float(s.top_p),
        "top_k": int(s.top_k) if s.top_k > 0 else -1,  # SGLang: -1 = off (miles: 0)
        "max_new_tokens": int(s.max_new_tokens),
        # Without stop ids a request runs to max_new_tokens (parity with the embedded engine, which
        # stops only on the caller's ids): ignore_eos. With them it must be off, because SGLang's
        # ignore_eos turns off every token-based stop, the caller's stop_token_ids included
        # (0.5.17, Req._check_token_based_finish): session 17's GSM8K run on SGLang ran every answer
        # to 512 tokens past <|im_end|>. SGLang then also stops on the checkpoint's own eos ids;
        # the tokenizer's stop ids that miles sends normally hold them (rollout/tokens/tokenizer.py).
        "ignore_eos": not s.stop_token_ids,
    }
    if s.stop_token_ids:
        out["stop_token_ids"] = [int(t) for t in s.stop_token_ids]
    if s.seed is not None:
        out["sampling_seed"] = int(s.seed)
    return out


def generate_payload(req: GenerateRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "rid": req.request_id,
        "input_ids": list(req.input_ids),
        "sampling_params": sampling_payload(req),
        "return_logprob": True,
        # Only output-token logprobs: the prompt's would cost a full-vocab softmax per prompt token.
        "logprob_start_len": -1,
        "stream": False,
    }
    if req.return_routed_experts:
        body["return_routed_experts"] = True
    return body


def parse_version(v: Any, where: str) -> int:
    """SGLang weight_version strings are miles' integer versions ('default' = 0, the launch weights)."""
    if v in (None, "default"):
        return 0
    try:
        return int(v)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{where}: weight_version {v!r} is not an integer version set by miles") from exc


def decode_routed_experts(b64: str, n_rows: int | None, facts: ModelFacts, where: str) -> np.ndarray:
    """base64 int32 [rows, L, k] -> compact [rows, L_moe, k] (uint8 / uint16). L is either every
    decoder layer (the MoE ones are kept) or only the MoE layers; `n_rows` None = infer (aborts)."""
    if not facts.num_experts:
        raise ProtocolError(f"{where}: routed_experts returned for a dense model")
    raw = np.frombuffer(base64.b64decode(b64), dtype="<i4")
    k, n_moe = facts.top_k, len(facts.moe_layers)
    for n_layers in dict.fromkeys((facts.num_layers, n_moe)):
        per_row = n_layers * k
        if per_row and raw.size % per_row == 0 and (n_rows is None or raw.size == n_rows * per_row):
            break
    else:
        raise ProtocolError(
            f"{where}: routed_experts has {raw.size} ids; expected rows={n_rows} x layers "
            f"({facts.num_layers} or {n_moe} MoE) x k={k}"
        )
    arr = raw.reshape(-1, n_layers, k)
    if n_layers != n_moe:
        arr = arr[:, list(facts.moe_layers)]  # one row per decoder layer: keep the MoE ones
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= facts.num_experts):
        raise ProtocolError(f"{where}: routed_experts ids outside [0, {facts.num_experts})")
    return arr.astype(expert_id_dtype(facts.num_experts))


def parse_generate(body: Any, req: GenerateRequest, facts: ModelFacts) -> GenerateResult:
    """One `/generate` response object -> GenerateResult (ids taken from the logprob records)."""
    where = f"sglang /generate {req.request_id}"
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ProtocolError(f"{where}: response has no meta_info object: {str(body)[:200]}")
    meta = body["meta_info"]
    recs = meta.get("output_token_logprobs")
    if not isinstance(recs, list):
        raise ProtocolError(f"{where}: meta_info.output_token_logprobs missing (was return_logprob sent?)")
    try:
        logprobs = [float(r[0]) for r in recs]
        ids = [int(r[1]) for r in recs]
    except (TypeError, ValueError, IndexError) as exc:
        raise ProtocolError(f"{where}: bad output_token_logprobs record ({exc})") from exc
    out_ids = body.get("output_ids")
    if out_ids is not None and list(out_ids) != ids:
        raise ProtocolError(f"{where}: output_ids disagree with the ids in output_token_logprobs")
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind not in _FINISH:
        raise ProtocolError(f"{where}: unknown finish_reason {fr!r}")
    version = parse_version(meta.get("weight_version"), where)
    prompt = int(meta.get("prompt_tokens", len(req.input_ids)))
    if prompt != len(req.input_ids):
        raise ProtocolError(f"{where}: server counted {prompt} prompt tokens, request had {len(req.input_ids)}")
    routed: np.ndarray | None = None
    if req.return_routed_experts:
        b64 = meta.get("routed_experts")
        if kind == "abort" and not isinstance(b64, str):
            # Measured on the H200 (0.5.17): a request aborted by /pause_generation answers without
            # routed_experts. Its partial output is continued (retract) and the continuation's
            # routing covers the whole sequence, so nothing is lost here (rollout/routing/requests.py).
            routed = None
        elif not isinstance(b64, str):
            raise ProtocolError(
                f"{where}: routed_experts missing; start the server with --enable-return-routed-experts"
            )
        else:
            routed = decode_routed_experts(b64, None if kind == "abort" else prompt + len(ids) - 1, facts, where)
            if kind != "abort" and len(routed):
                routed = np.concatenate([routed, routed[-1:]])  # the never-fed last token (module doc)
    return GenerateResult(
        request_id=req.request_id,
        output_ids=ids,
        logprobs=logprobs,
        finish_reason=_FINISH[kind],
        versions=[version] * len(ids),
        prompt_tokens=prompt,
        cached_tokens=int(meta.get("cached_tokens") or 0),
        routed_experts=routed,
    )
