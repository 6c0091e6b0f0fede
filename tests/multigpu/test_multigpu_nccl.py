"""Two-GPU checks (NCCL): miles' broadcast channel moves every byte GPU 0 -> GPU 1, and a
2-rank FSDP2 step equals the 1-rank step within the stated bf16 tolerance. They drive the
bench/multi_gpu scripts with small sizes and skip where fewer than two GPUs are visible."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "multi_gpu"
pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"needs 2 CUDA GPUs for NCCL between processes; {torch.cuda.device_count()} visible",
)


def _run(script: str, *args: str) -> dict:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    out = subprocess.run([sys.executable, str(BENCH / script), "--device", "cuda", *args],
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_nccl_broadcast_channel_moves_every_byte(tmp_path: Path) -> None:
    res = _run("weight_sync_nccl.py", "--sizes-gb", "0.4", "--buckets-mib", "64", "256", "--repeats", "1",
               "--out", str(tmp_path / "ws.json"))
    assert res["backend"] == "nccl"
    assert [r["bucket_mib"] for r in res["rows"]] == [64, 256]
    assert all(r["verified"] and r["n_buckets"] >= 2 for r in res["rows"])


@pytest.mark.timeout(300)
def test_two_gpu_fsdp_step_equals_one_gpu(tmp_path: Path) -> None:
    res = _run("fsdp_2gpu.py", "--steps", "1", "--groups", "4", "--seq", "256", "--out", str(tmp_path / "f.json"))
    assert res["equal_within_tolerance"], res["metrics"]
    assert res["update_cosine"] >= res["tolerance"]["update_cosine_min"]
