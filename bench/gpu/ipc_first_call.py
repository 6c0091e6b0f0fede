"""Does mapping a CUDA IPC handle as a process's FIRST CUDA call crash it? (issue 45: the SGLang engine
role died of SIGSEGV at its first cuda_ipc weight push; it runs no model, so the mapping was its first
CUDA call.) Pure torch, no miles imports: the parent shares a CUDA storage; fresh child interpreters map
it through `torch.UntypedStorage._new_shared_cuda` (what transport/bulk/cuda_ipc.py's receiver calls),
once as the first CUDA call and once after `torch.cuda.init()` (the receiver's fix). Prints a table and,
last, one JSON line.

    python3 bench/gpu/ipc_first_call.py
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import torch

CHILD = r"""
import base64, json, sys, torch
fields = [base64.b64decode(f["b"]) if isinstance(f, dict) else f for f in json.loads(sys.stdin.read())]
if sys.argv[1] == "init":
    torch.cuda.init()
st = torch.UntypedStorage._new_shared_cuda(*fields)
t = torch.empty(0, dtype=torch.float32, device=st.device).set_(st, 0, (st.nbytes() // 4,))
print(float(t.double().sum()))
"""


def main() -> None:
    src = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    fields = src.untyped_storage()._share_cuda_()
    wire = json.dumps([{"b": base64.b64encode(f).decode()} if isinstance(f, bytes) else f for f in fields])
    want = float(src.double().sum())
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "want_sum": want}
    print(f"{'child':<22}{'rc':>6}  result")
    for mode in ("first_call", "init"):
        p = subprocess.run([sys.executable, "-c", CHILD, mode], input=wire, capture_output=True, text=True,
                           timeout=120)
        got = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr.strip().splitlines()[-1:] or [""]
        out[mode] = {"rc": p.returncode, "ok": p.returncode == 0 and got == str(want), "out": str(got)[:200]}
        print(f"{mode:<22}{p.returncode:>6}  {str(got)[:80]}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
