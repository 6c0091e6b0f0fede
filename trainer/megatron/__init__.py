"""The megatron-core trainer backend (optional extra `megatron`; CUDA and Python >= 3.12 only).

`layout` (HF <-> megatron names, QKV / gate-up fusing, tensor-parallel slicing) is plain
torch and runs anywhere; every other module imports megatron-core lazily, inside the
functions that need it.
"""
