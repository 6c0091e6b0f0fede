"""The trainer's 'auto' values that depend on the machine and the model, resolved from facts.

Every other 'auto' is settled when its section is built (the section's `__post_init__`, or
core/schema/resolve.py across sections; an optional package's presence counts there, as the
launcher and the roles run the same interpreter). What is left depends on facts only the
process that trains can see: whether a CUDA device is visible (a Slurm login node has none),
and whether the policy is a mixture of experts (its config.json). `resolve_trainer` settles
them when each trainer backend starts, with its own facts (on a cluster, the compute node's; a
concrete value passes unchanged), and trainer rank 0 records the result in the run directory's
config (metrics/run_dir.py record_trainer). The launcher does not import torch to ask for CUDA
(about 1 s before any role starts: tests/launch/test_launch_startup_imports.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from miles.core.schema.trainer import TrainerConfig


@dataclass(frozen=True)
class RuntimeFacts:
    """What resolving the trainer's machine-dependent options needs to know of this process."""

    cuda: bool  # a CUDA device is visible

    @classmethod
    def probe(cls) -> RuntimeFacts:
        """This process's facts (imports torch to ask for CUDA)."""
        import torch

        return cls(cuda=torch.cuda.is_available())


def resolve_trainer(tr: TrainerConfig, facts: RuntimeFacts, *, moe: bool) -> TrainerConfig:
    """`tr` with device, param_dtype, optim.impl, compile and packed_attention concrete
    (`moe`: the policy model has expert layers)."""
    device = tr.device
    if device == "auto":  # megatron-core trains on CUDA only (its start says so where there is none)
        device = "cuda" if facts.cuda or tr.backend == "megatron" else "cpu"
    on_cuda = device == "cuda"
    dtype = tr.param_dtype
    if dtype == "auto":
        dtype = "bfloat16" if on_cuda else "float32"
    impl = tr.optim.impl
    if impl == "auto":
        impl = "fused" if on_cuda else "single"
    compile_ = tr.compile
    if compile_ == "auto":
        # compiled blocks measured faster only for a dense model on CUDA, and never under true-on-policy,
        # whose invariant kernels replace the block ops; 'try' keeps a compile error from ending the run
        compile_ = "try" if on_cuda and not moe and not tr.true_on_policy else "off"
    packed = tr.packed_attention
    if packed == "auto":
        # off CUDA there are no flash kernels for varlen to reach: the mask, whatever the pack length
        packed = "by_length" if on_cuda else "masked"
    # the sections rebuilt: what their own construction resolves holds for values set after it too
    return replace(tr, device=device, param_dtype=dtype, compile=compile_, packed_attention=packed,
                   optim=replace(tr.optim, impl=impl), correction=replace(tr.correction),
                   megatron=replace(tr.megatron))
