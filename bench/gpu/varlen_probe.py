import time, torch, sys
sys.path.insert(0, "/tmp/pkg")
from miles.models.config import ModelSpec
from miles.models.presets import tiny_config
from miles.models.registry import build_model
spec = ModelSpec.from_hf(tiny_config("qwen3_moe", vocab_size=4096, hidden_size=1024, num_hidden_layers=12, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, num_attention_heads=16, num_key_value_heads=4))
m = build_model(spec, dtype=torch.bfloat16, device="cuda", seed=0)
for n_seq, L in ((128, 128), (16, 1024), (8, 2048)):
    T = n_seq * L
    cu = torch.arange(0, T + 1, L, dtype=torch.int32, device="cuda")
    ids = torch.randint(0, 4096, (1, T), device="cuda")
    for mode in ("masked", "varlen", "masked", "varlen"):
        m.packed_attention = mode
        torch.cuda.synchronize(); t0 = time.perf_counter()
        out = m(ids, cu_seqlens=cu).logits; out.float().mean().backward()
        torch.cuda.synchronize(); dt = time.perf_counter() - t0
        print(f"{n_seq} seqs x {L}: {mode} {dt*1000:.0f} ms", flush=True)
