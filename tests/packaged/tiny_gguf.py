"""A real, tiny qwen2 GGUF file written with the `gguf` package, and its parts packed as wheels.

One decoder layer, hidden 32, a byte-level BPE vocabulary of the 256 byte symbols, two merges and
the three ChatML control tokens, miles' tiny ChatML template. Random weights from a seed; one
tensor is stored Q8_0, so the conversion dequantizes a block format as it does for the real files.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np

from miles.packaged.registry import PackagedModel, Part
from miles.rollout.tokens.tiny_tokenizer import CHATML_TEMPLATE

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 32, 64, 2, 1, 1  # Q8_0 blocks are 32 wide
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["u s", "e r"]


def _byte_symbols() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (the order transformers' byte-level BPE uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_tiny_gguf(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """Write the file; return its tensors by GGUF name (the Q8_0 one as its float values)."""
    import gguf

    tokens = _byte_symbols() + [m.replace(" ", "") for m in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # 1 normal, 3 control
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2 test model")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)
    w.add_pad_token_id(vocab - 3)
    w.add_chat_template(CHATML_TEMPLATE)
    rng = np.random.default_rng(seed)
    hd = HIDDEN // HEADS

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)

    t = {"token_embd.weight": mat(vocab, HIDDEN), "output_norm.weight": np.ones(HIDDEN, np.float32),
         "output.weight": mat(vocab, HIDDEN)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        t |= {b + "attn_norm.weight": np.ones(HIDDEN, np.float32), b + "ffn_norm.weight": np.ones(HIDDEN, np.float32),
              b + "attn_q.weight": mat(HEADS * hd, HIDDEN), b + "attn_q.bias": mat(1, HEADS * hd)[0],
              b + "attn_k.weight": mat(KV_HEADS * hd, HIDDEN), b + "attn_k.bias": mat(1, KV_HEADS * hd)[0],
              b + "attn_v.weight": mat(KV_HEADS * hd, HIDDEN), b + "attn_v.bias": mat(1, KV_HEADS * hd)[0],
              b + "attn_output.weight": mat(HIDDEN, HEADS * hd), b + "ffn_gate.weight": mat(FFN, HIDDEN),
              b + "ffn_up.weight": mat(FFN, HIDDEN), b + "ffn_down.weight": mat(HIDDEN, FFN)}
    q8 = "blk.0.ffn_up.weight"
    for name, arr in t.items():
        if name == q8:
            packed = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            t[name] = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return t


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split_as_wheels(gguf_path: Path, wheel_dir: Path, n_parts: int, name: str = "tiny-test",
                    bare_dir: Path | None = None) -> PackagedModel:
    """Cut the file into n parts, pack part i as the wheel `tiny_part{i}-1.0-py3-none-any.whl`
    (and, with bare_dir, also as the bare file), and return the registry entry that describes them."""
    data = gguf_path.read_bytes()
    cut = [len(data) * i // n_parts for i in range(n_parts + 1)]
    parts = []
    wheel_dir.mkdir(parents=True, exist_ok=True)
    for i in range(n_parts):
        chunk = data[cut[i]:cut[i + 1]]
        member = f"tiny_part{i + 1}/data/part{i + 1:02d}.bin"
        with zipfile.ZipFile(wheel_dir / f"tiny_part{i + 1}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"tiny_part{i + 1}/__init__.py", "")
            z.writestr(member, chunk)
        if bare_dir is not None:
            bare_dir.mkdir(parents=True, exist_ok=True)
            (bare_dir / f"part{i + 1:02d}.bin").write_bytes(chunk)
        parts.append(Part(f"tiny-part{i + 1}==1.0", member, len(chunk), sha256(chunk)))
    return PackagedModel(name=name, title="tiny qwen2 test model", parts=tuple(parts), size=len(data),
                         sha256=sha256(data), gguf_name="tiny.gguf", architecture="qwen2", dtype="bfloat16",
                         default_out=str(wheel_dir.parent / "hf"))
