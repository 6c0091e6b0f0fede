"""Config section for the rollout side: environment, layers, sampling, sessions, router."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from miles.core.config import opt

# the choices' types, which the plain classes that take them (rollout/tito/store.py) declare too
SessionPolicy = Literal["linear", "branching"]
MatchPolicy = Literal["strict", "loose_tool_call", "role_content"]
TemplateFallback = Literal["none", "anchor_diff"]
RenderMode = Literal["auto", "full", "local"]


def resolve_render_mode(mode: RenderMode, local_ok: Callable[[], bool]) -> Literal["full", "local"]:
    """rollout.render_mode for the policy's tokenizer, which only the rollout process loads: auto =
    local when the chat template renders locally the same as whole (`local_ok`, asked only then)."""
    if mode == "auto":
        return "local" if local_ok() else "full"
    return mode


@dataclass
class RolloutConfig:
    env: str = opt(
        "miles.rollout.envs.arithmetic:make_env",
        "import path of `make_env(**env_args) -> Environment` (prompts, reward, agent, tools); "
        "built-in: miles.rollout.envs.arithmetic | .calculator | .openai_agent | .dataset (a JSONL/Parquet "
        "file with named rule rewards, see docs/datasets.md)",
    )
    env_args: dict[str, Any] = opt(
        {}, "keyword arguments passed to the env's make_env (e.g. seed, max_operand); the keys path, *_path, "
        "*_file and *_dir are paths (relative: from the config file's folder, or from the working directory "
        "when given with --set)")
    rollout_fn: str = opt(
        "miles.rollout.layers:default_rollout",
        "rollout layer: `async def rollout(ctx: RolloutContext, prompt: dict) -> Group` "
        "(the n samples of one prompt, each with a reward)",
    )
    generate_fn: str = opt(
        "miles.rollout.layers:default_generate",
        "generate layer: `async def generate(ctx: GenerateContext) -> list[Sample]` (one trajectory: "
        "open a session, run the agent, export, close)",
    )
    agent_fn: str = opt(
        "",
        "agent layer: `async def agent(ctx: AgentContext) -> dict | None` (multi-turn harness talking "
        "to ctx.client or, as a black box, to ctx.base_url); empty = the env's agent",
    )
    reward_fn: str = opt("", "`(prompt: dict, sample: Sample) -> float` (may be async); empty = the env's reward")
    n_samples_per_prompt: int = opt(8, "trajectories per prompt (the group size)", "samples")
    max_turns: int = opt(8, "most assistant turns an agent may take in one trajectory", "turns")
    temperature: float = opt(
        1.0, "sampling temperature (0 = greedy); each sample carries the temperature it was drawn with "
        "(this, a prompt's own `sampling`, or an HTTP request's) and the trainer takes its logprobs under it")
    top_p: float = opt(
        1.0, "nucleus sampling mass; only 1 (off): engine and trainer take logprobs of the untruncated "
        "distribution, so truncated samples would train with biased importance weights (refused here, "
        "and per prompt or request)")
    top_k: int = opt(-1, "top-k sampling; only -1 or 0 (off), for the reason given under top_p")
    max_new_tokens: int = opt(1024, "most tokens the engine samples per turn", "tokens")
    session_policy: SessionPolicy = opt(
        "linear",
        "linear: a request whose history diverges from the stored one is rejected (Diverged); "
        "branching: it forks a child and every leaf is exported as a trajectory",
    )
    match_policy: MatchPolicy = opt(
        "loose_tool_call",
        "when a stored message equals an incoming one: strict (role, content, reasoning, tool calls "
        "as text), loose_tool_call (tool-call arguments compared as parsed JSON), role_content",
    )
    template_fallback: TemplateFallback = opt(
        "none",
        "what to do when the chat template fails the append-only check: none = refuse (NotAppendOnly); "
        "anchor_diff = tokenize appended messages after a reasoning-free anchor (see rollout/tokens/template_check.py)",
    )
    render_mode: RenderMode = opt(
        "auto",
        "how a turn renders the chat: full = the whole conversation; local = only the system prompt, "
        "the last stored turn and the new messages (fast); auto = local when the template passes "
        "the locality check on the canonical conversations, else full",
    )
    tool_parser: str = opt("json_tags", "named parser turning model text into tool_calls: json_tags | none")
    reasoning_tags: list[str] = opt(
        ["<think>", "</think>"], "open/close tags of reasoning text split into reasoning_content; [] = off"
    )
    max_sessions: int = opt(100_000, "most open sessions the session store holds", "sessions")
    router_affinity: bool = opt(
        True, "route every turn of a session to the engine that served its first turn (KV-cache reuse)"
    )
    engine_sessions: bool = opt(
        True, "a multi-turn trajectory's turns carry its session id to the engine, which keeps the turn's KV "
        "for the next turn (prefill of the new tokens only; freed when the session closes or its group ends); "
        "off = every turn prefills its whole context. The torch engine's (SGLang's radix cache reuses "
        "prefixes by itself)"
    )
    http_front: bool = opt(
        False, "serve the OpenAI-compatible session front from the rollout process, so black-box agents "
        "(e.g. miles.rollout.envs.openai_agent) reach their session at ctx.base_url"
    )
    http_port: int = opt(0, "port of that front; 0 = any free port (bound on transport.interface)")
    http_token_file: str = opt(
        "", "file holding the bearer token the HTTP front requires of every request but /health (mode 0600, "
        ">= 16 characters); agents get it as ctx.api_key. '' = none, or with transport.curve = true the "
        "launcher writes a fresh one beside the run's keys", "path"
    )
    reward_errors: Literal["stop", "drop"] = opt(
        "stop", "what a reward-function exception does: the sample is dropped (counted by type, logged "
        "with the prompt id) and, with stop, the run ends after reward_max_errors_in_a_row in a row"
    )
    reward_max_errors_in_a_row: int = opt(
        3, "reward-function failures in a row (no success between) that end the run when "
        "reward_errors = stop", "samples"
    )
    generate_timeout_s: float = opt(
        120.0, "deadline of one engine generate request, covering its queueing and the whole "
        "generation (a lost request or reply fails its trajectory after this long)", "s"
    )
    max_failures_in_a_row: int = opt(
        256, "stop the run when this many trajectories fail in a row with no success (the error names "
        "the last cause); 0 = never", "trajectories"
    )

    def sampling(self) -> dict[str, Any]:
        """The sampling every request starts from (a prompt's or an HTTP request's own sampling
        overrides it); top_k -1 is sent as 0, which every engine reads as "no top-k"."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": max(0, self.top_k),
                "max_new_tokens": self.max_new_tokens}

    def __post_init__(self) -> None:
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
        if self.generate_timeout_s <= 0:
            raise ValueError(f"generate_timeout_s must be > 0, got {self.generate_timeout_s}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_p != 1.0 or self.top_k > 0:
            raise ValueError(f"top_p={self.top_p}, top_k={self.top_k}: truncated sampling is not trained on "
                             "(engine and trainer take logprobs of the untruncated distribution, so the "
                             "importance weights would be biased); use top_p = 1 and top_k = -1")
        if self.reasoning_tags and len(self.reasoning_tags) != 2:
            raise ValueError(f"reasoning_tags must be [open, close] or [], got {self.reasoning_tags}")


DEFAULTS = RolloutConfig()  # the defaults of the plain classes that take these options one by one
