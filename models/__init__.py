"""Decoder LMs (Llama, Qwen2, Qwen3, Qwen3-MoE) and HF checkpoint IO, shared by engines and trainer."""
