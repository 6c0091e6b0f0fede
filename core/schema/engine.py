"""Config section for rollout engines: type, count, placement, batching and KV cache."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from miles.core.config import opt
from miles.core.errors import ConfigError


@dataclass
class EngineConfig:
    type: str = opt("torch", "engine implementation: torch (embedded) | sglang (external server)")
    num_engines: int = opt(1, "number of engine processes")
    device: str = opt("cpu", "torch device of the embedded engine: cpu | cuda | cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "compute dtype of the engine; auto = float32 for the torch engine, bfloat16 for sglang (its "
        "kernels have no float32)"
    )
    max_batch_size: int = opt(32, "most sequences decoded together in one step", "sequences")
    max_seq_len: int = opt(4096, "longest prompt + completion a request may reach", "tokens")
    kv_budget_tokens: int = opt(
        65536, "tokens of idle session KV kept for prefix reuse before LRU eviction", "tokens"
    )
    session_kv_reuse: Literal["same_version", "any"] = opt(
        "same_version",
        "which saved session KV a session's next turn reuses: same_version = only KV every position of which "
        "the serving weight version wrote (KV written under older weights, e.g. by a turn that decoded across "
        "an in-place update, is dropped and the prompt recomputed); any = also KV of older versions (saves "
        "the prefill, but the turn's logits then rest on keys and values of weights it was not sampled "
        "under). The torch engine's; SGLang flushes its cache at every weight update",
    )
    kv_layout: Literal["rows", "paged"] = opt(
        "rows",
        "torch engine KV layout: rows = one max_seq_len row per running sequence (CUDA-graphed decode); "
        "paged = blocks of kv_block_tokens in a pool of kv_pool_tokens, each sequence holding only the blocks "
        "its length needs, a GRPO group's prompt blocks shared by reference (engines/paged_kv.py); a request is "
        "admitted once the pool can reserve prompt + max_new_tokens (less the prompt blocks it shares); attention "
        "reads K/V gathered through the block tables (a copy per layer and step); cuda_graphs apply, compile_decode "
        "and overlap_decode do not. H200 (bench/results/paged_kv_h200.txt): KV in use 8x smaller than rows, at 0.83x / 0.68x "
        "the rows' tok/s at batch 32 / 128 and 0.39x on 8x8 groups of 1k-token prompts (no paged attention kernel; rows "
        "then uncompiled and step by step)",
    )
    kv_block_tokens: int = opt(16, "kv_layout=paged: tokens per KV block", "tokens")
    kv_pool_tokens: int = opt(
        0,
        "kv_layout=paged: KV the block pool holds for running sequences, rounded up to whole blocks "
        "(its memory: this x the model's KV bytes per token); 0 = max_batch_size x max_seq_len, the rows "
        "layout's size",
        "tokens",
    )
    max_queue: int = opt(4096, "most requests waiting for a batch slot; more are refused", "requests")
    batch_invariant: bool = opt(
        False,
        "torch engine: batch-invariant kernels (logprobs equal the trainer's bit for bit; needed by "
        "trainer.true_on_policy; dense and MoE; slower)",
    )
    mps_thread_percent: int = opt(
        0,
        "CUDA MPS: the share of the GPU's SMs this engine's kernels may occupy "
        "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, set in the engine process before CUDA starts), so that a "
        "colocated trainer's kernels run beside decode instead of time-sliced with it; takes effect "
        "only while an MPS control daemon runs (nvidia-cuda-mps-control -d); the engine checks its bf16/fp16 "
        "GEMMs at start and refuses where the BLAS is wrong under the limit (cuBLAS on the H200 with "
        "torch 2.11+cu130 at 40%: docs/orchestration.md); 0 = no limit",
        "%",
    )
    cuda_graphs: bool = opt(True, "torch engine on CUDA: replay decode steps as CUDA graphs per batch-size bucket")
    compile_decode: bool = opt(
        True,
        "torch engine on CUDA with cuda_graphs over kv_layout=rows, outside batch_invariant: torch.compile the "
        "decode forward before capturing it (fused norms, rotary, activations; a MoE model's experts run densely "
        "on the decode batch). One dynamic-shape compile per process (50-110 s on an H200 for bench/engine.py's "
        "models), made while the engine serves (compile_background) or before; a compile that fails falls back to "
        "the uncompiled graphs",
    )
    compile_decode_cpu: bool = opt(
        False,
        "torch engine on CPU over kv_layout=rows, outside batch_invariant (dense and MoE; not vision-language): "
        "torch.compile (Inductor, C++ kernels) the decode forward, padded as the CUDA graphs pad it (batch to a "
        "power of two, keys to the pool's width, masked), so a step runs a few fused kernels instead of ~180-270 "
        "small eager ops; prefill stays eager. One dynamic-shape compile per process, in warm_up or the first "
        "decode step (10-35 s on 2 shared cores for bench/engine.py's CPU models; Inductor's on-disk cache "
        "shortens later ones). Logprobs differ from the eager step's by rounding only (fused ops); a MoE model's "
        "experts run densely on the decode batch. A compile that fails leaves decode eager. 2 shared cores, b8 "
        "(bench/results/engine_cpu_s17.txt): dense 2.3-2.5x eager transformers where the eager engine is 1.5-1.6x, "
        "MoE 1.8-2.3x where it is 1.3-1.6x. Off by default: the compile outweighs the gain for short runs and tests",
    )
    compile_background: bool = opt(
        False,
        "with compile_decode: the engine serves at once with uncompiled decode graphs while the compile runs in "
        "a worker thread (on a 2-row KV pool of its own), and swaps the compiled graphs in between two decode hops "
        "when it is ready (logged as decode_compile_started / decode_compile_ready); the first steps of a run no "
        "longer wait for it. Off by default: its first H200 run (the quick start on CUDA, weights committed "
        "while it compiled) hit a CUDA caching-allocator INTERNAL ASSERT in the compile thread and then served "
        "corrupt routed-expert ids, which the trainer refused (bench/results/sglang_e2e_h200.json, qs-torch-0); "
        "its cause (the swap captured into a pool whose graphs were all gone, and the failed capture left the "
        "thread on its capture stream) is fixed in engines/cuda_graph.py, and its GPU tests pass on an H100 "
        "(session 21); the launched run that failed has not been rerun, so the default stays off. "
        "false = compile before the engine registers (the run's first step waits for the compile)",
    )
    overlap_decode: bool = opt(
        True,
        "torch engine with decode CUDA graphs over kv_layout=rows: launch decode step k+1 from step k's "
        "sampled ids on the GPU before the host reads step k, so the scheduler's per-token work runs while the "
        "GPU computes (a sequence that finishes at step k has its step-k+1 token computed and dropped); "
        "false = the host reads every step before launching the next",
    )
    share_prompts: bool = opt(
        True,
        "torch engine: compute a prompt's KV once and copy it: requests admitted together with identical ids "
        "(a GRPO group's n samples) prefill one of them; a newcomer copies what a running row holds of its "
        "prompt (all of it, or whole 64-token blocks) under the same weights (engines/prompt_share.py; "
        "bit-equal results under batch_invariant)",
    )
    fp8_gemm: bool = opt(
        True,
        "torch engine on CUDA under model.fp8 (docs/fp8.md): real FP8 GEMMs with activations quantized per token "
        "and 128 columns (H200: faster than bf16 from hidden ~4096, slower at 1-2k); false = the FP8 weights "
        "dequantized into bf16 GEMMs (activations exact, logprobs closest to the trainer's)",
    )
    # ---- type = "sglang": a stock SGLang server driven over HTTP (engines/sglang.py) ----
    sglang_url: str = opt("", "URL of an already running SGLang server; '' = launch one (sglang_model_path)")
    sglang_model_path: str = opt("", "HF checkpoint directory the launched server loads (config.json + safetensors)",
                                 "path")
    sglang_host: str = opt("127.0.0.1", "host the launched server binds")
    sglang_port: int = opt(30000, "port of engine 0's launched server; engine i listens on sglang_port + i "
                           "(a snapshot eval engine on sglang_port + num_engines)")
    sglang_tp: int = opt(1, "tensor-parallel size of the launched server", "GPUs")
    sglang_dp: int = opt(1, "data-parallel size of the launched server", "replicas")
    sglang_mem_fraction: float = opt(
        0.0, "--mem-fraction-static of each launched server: its share of a GPU for weights + KV cache; 0 = auto: "
        "0.85 split evenly between the servers that share a GPU, 0.45 when the trainer is on that GPU too "
        "(launch/sglang_checks.py; explicit values are checked against the same budget). SGLang 0.5.17 also "
        "refuses a fraction below the share other processes already hold when it starts (measured on an H100: "
        "with 26 GB of 80 in use it asked for >= 0.242), so start it before other runs fill the card"
    )
    sglang_placement: Literal["shared", "spread"] = opt(
        "shared", "GPUs of the launched servers: shared = every engine's server on the same GPUs (0 .. tp*dp-1, "
        "colocated, memory split by sglang_mem_fraction); spread = engine i on its own GPUs from i*tp*dp "
        "(--base-gpu-id)"
    )
    sglang_base_gpu: int = opt(0, "first GPU of this engine's server (--base-gpu-id); set per engine from "
                               "sglang_placement, not by hand", "GPU")
    sglang_weight_update: Literal["auto", "disk", "tensor"] = opt(
        "auto", "how a committed version reaches the server: tensor = in memory, the staged tensors handed over "
        "by reference (/update_weights_from_tensor; CUDA IPC handles when the engine stages on the server's GPU); "
        "disk = a safetensors folder per version (/update_weights_from_disk), which reaches any server; "
        "auto = tensor when engine.device is cuda (colocated), else disk"
    )
    sglang_return_routed_experts: bool = opt(False, "start with --enable-return-routed-experts (R3 on a MoE model)")
    sglang_extra_args: list[str] = opt([], "more launch_server arguments, passed as given")
    sglang_python: str = opt("", "python executable that runs sglang.launch_server; '' = this one")
    sglang_startup_timeout_s: float = opt(600.0, "longest wait for a (re)started server to answer /health", "s")
    sglang_request_timeout_s: float = opt(3600.0, "longest wait for one HTTP call to the server", "s")
    sglang_max_restarts: int = opt(3, "restarts after a crash of the launched server before giving up", "restarts")
    sglang_port_wait_s: float = opt(
        60.0, "how long a starting server waits for its port to be free before failing: a restarted engine "
        "role's old server is still shutting down (it got SIGTERM when that role died; SGLang takes seconds "
        "to exit, and the H100 restart of session 17 failed 4 s after the crash on 'port in use')", "s")
    sglang_stage_dir: str = opt("", "folder for staged weight versions (update from disk); '' = a temp dir", "path")
    ready_wait_s: float = opt(
        900.0, "how long, at start, the rollout process waits for every engine to register and the trainer for "
        "the engines and the rollout process: it covers loading weights, warm-up compiles and a launched sglang "
        "server's start (sglang_startup_timeout_s, which it must exceed); a role still missing then fails the "
        "run at start", "s")

    # Keys that were removed, with where their setting lives now (core/config.py reports them).
    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "pause_mode": "it was only checked, never sent; the one pause option is sync.pause_mode (default auto: "
                      "in_place for the torch engine, retract for sglang)",
    }

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.type == "sglang" else "float32"
        if self.sglang_weight_update == "auto":  # tensors by reference reach only a server on this GPU
            self.sglang_weight_update = "tensor" if self.device.startswith("cuda") else "disk"
        for name in ("num_engines", "max_batch_size", "max_seq_len", "max_queue"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine.{name}={getattr(self, name)} must be >= 1")
        if self.kv_budget_tokens < 0:
            raise ConfigError(f"engine.kv_budget_tokens={self.kv_budget_tokens} must be >= 0")
        if not 0 <= self.mps_thread_percent <= 100:
            raise ConfigError(f"engine.mps_thread_percent={self.mps_thread_percent}: expected 0 (no limit) "
                              "to 100 (% of the GPU's SMs)")
        if self.kv_block_tokens < 1 or self.kv_pool_tokens < 0:
            raise ConfigError(
                f"engine.kv_block_tokens={self.kv_block_tokens} must be >= 1 and "
                f"engine.kv_pool_tokens={self.kv_pool_tokens} >= 0"
            )
        if self.ready_wait_s <= 0:
            raise ConfigError(f"engine.ready_wait_s={self.ready_wait_s} must be > 0 (seconds)")
        if self.type == "sglang":
            self._check_sglang()
            if not self.sglang_url and self.ready_wait_s <= self.sglang_startup_timeout_s:
                raise ConfigError(
                    f"engine.ready_wait_s={self.ready_wait_s:g} must exceed engine.sglang_startup_timeout_s="
                    f"{self.sglang_startup_timeout_s:g}: the other roles would give up on a server still starting")
        if self.dtype == "float16" and self.device == "cpu":
            raise ConfigError("engine.dtype=float16 is not supported on cpu; use float32 or bfloat16")

    @property
    def default_pause_mode(self) -> Literal["retract", "in_place"]:
        """sync.pause_mode 'auto' resolved for this engine type."""
        return "retract" if self.type == "sglang" else "in_place"

    def for_engine(self, index: int) -> EngineConfig:
        """The config of engine `index`: its own server port (and GPUs under sglang_placement=spread)."""
        if self.type != "sglang" or self.sglang_url:
            return self
        base = self.sglang_base_gpu + (index * self.gpus_per_server if self.sglang_placement == "spread" else 0)
        return replace(self, sglang_port=self.sglang_port + index, sglang_base_gpu=base)

    @property
    def gpus_per_server(self) -> int:
        return self.sglang_tp * self.sglang_dp

    def servers_per_gpu(self, eval_engine: bool = False) -> int:
        """How many launched servers share one GPU under sglang_placement."""
        return self.num_engines + int(eval_engine) if self.sglang_placement == "shared" else 1

    def sglang_mem_budget(self, trainer_on_gpu: bool) -> float:
        """The share of a GPU all launched servers on it may claim together (headroom rules: SGLang
        needs memory outside its static pool for activations and graphs; a colocated trainer its model,
        gradients and optimizer state). Not measured: a starting point the launch check holds explicit
        fractions to; raise it with an explicit sglang_mem_fraction only below this budget."""
        return 0.45 if trainer_on_gpu else 0.85

    def _check_sglang(self) -> None:
        for name in ("sglang_tp", "sglang_dp", "sglang_port"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine.{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.sglang_mem_fraction < 1:
            raise ConfigError(f"engine.sglang_mem_fraction={self.sglang_mem_fraction} must be in [0, 1) (0 = auto)")
        if self.sglang_max_restarts < 0:
            raise ConfigError(f"engine.sglang_max_restarts={self.sglang_max_restarts} must be >= 0")
