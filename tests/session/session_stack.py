"""Helpers for the session tests: a tiny model, a quick SFT warm-up, and an in-process stack.

The stack is the rollout process's real session path (bench/session_front.py): a
directory, engine actors over `TorchEngine`, and the session service with its HTTP
front over the rollout's request routing (EngineRequests + Dispatch), all on one host
in the test's event loop (every engine message still goes through ZeroMQ sockets).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles.actors.runtime.host import Host
from miles.bench import session_front
from miles.bench.session_front import SessionFront
from miles.core.schema.engine import EngineConfig
from miles.core.schema.transport import TransportConfig
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.presets import tiny_config
from miles.models.registry import build_model
from miles.rollout.envs.calculator import CALC_TOOL
from miles.rollout.tokens.tiny_tokenizer import tiny_tokenizer
from miles.rollout.tokens.tokenizer import HFTokenizer

QUESTION = "What is 12*3+4? Use the calc tool, then answer with the number."
ANSWER = "40"


def make_tok(tmp: Path) -> HFTokenizer:
    return tiny_tokenizer(tmp / "tok")


def tiny_lm(tok: HFTokenizer, seed: int = 0, **kw: Any) -> CausalLM:
    cfg = tiny_config("qwen3", vocab_size=tok.vocab_size, **kw)
    return build_model(ModelSpec.from_hf(cfg), seed=seed)


def tool_conversation() -> list[dict[str, Any]]:
    """THE TESTS' TARGET BEHAVIOUR: ask → calc tool call → tool result → final answer."""
    call = {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": {"expr": "12*3+4"}}}
    return [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": ANSWER},
            {"role": "assistant", "content": f"The answer is {ANSWER}."}]


def sft_tool_calls(model: CausalLM, tok: HFTokenizer, max_steps: int = 400) -> int:
    """Warm-up: teach the tiny model the two assistant turns of `tool_conversation` until greedy
    decoding reproduces them exactly (teacher-forced argmax == target everywhere). Returns steps."""
    msgs, tools = tool_conversation(), [CALC_TOOL]
    ids = tok.encode(tok.apply_chat_template(msgs, tools))
    mask = torch.zeros(len(ids), dtype=torch.bool)
    for k in (1, 3):  # the assistant turns: from the generation prompt through <|im_end|>
        start = len(tok.encode(tok.apply_chat_template(msgs[:k], tools, True)))
        end = len(tok.encode(tok.apply_chat_template(msgs[:k + 1], tools))) - 1  # drop the trailing "\n"
        mask[start:end] = True
    x = torch.tensor([ids[:-1]])
    y = torch.tensor(ids[1:])
    m = mask[1:]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra threads only contend on the shared 2-core machine
    try:
        return _train(model, opt, x, y, m, max_steps)
    finally:
        torch.set_num_threads(threads)


def _train(model: CausalLM, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor,
           max_steps: int) -> int:
    for step in range(1, max_steps + 1):
        logits = model(x).logits[0]
        loss = torch.nn.functional.cross_entropy(logits[m], y[m])
        # checked before the update, so the weights returned are the ones that passed
        if loss.item() < 0.05 and bool((logits[m].argmax(-1) == y[m]).all()):
            model.eval()
            return step
        opt.zero_grad()
        loss.backward()
        opt.step()
    raise AssertionError(f"warm-up did not memorise the tool-call turns in {max_steps} steps "
                         f"(loss {loss.item():.4f})")


_TRAINED: dict[int, dict[str, torch.Tensor]] = {}


def tool_calling_lm(tok: HFTokenizer) -> CausalLM:
    """A tiny model warmed up by `sft_tool_calls` (trained once per test process, then copied)."""
    model = tiny_lm(tok)
    if tok.vocab_size not in _TRAINED:
        sft_tool_calls(model, tok)
        _TRAINED[tok.vocab_size] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        model.load_state_dict(_TRAINED[tok.vocab_size])
    return model.eval()


def transport_cfg() -> TransportConfig:
    return TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)


async def start_host(cfg: TransportConfig | None = None) -> Host:
    """A host running the directory (the head of a small actor system)."""
    return await session_front.start_host(cfg or transport_cfg())


async def start_stack(tok: HFTokenizer, models: list[CausalLM], affinity: bool = True,
                      engine_cfg: EngineConfig | None = None) -> SessionFront:
    return await session_front.start_session_front(tok, models, affinity, engine_cfg, transport_cfg())
