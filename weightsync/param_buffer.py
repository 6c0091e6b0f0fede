"""Move a model's parameters into one contiguous buffer (a flat parameter buffer).

A trainer whose weights lie back to back in HF order can hand them to the engines as
byte ranges (weightsync/flat.py) instead of tensor by tensor; engines keep their own
weights this way so a bucket lands in one copy. Parameters keep their identity (only
`.data` moves), so optimizers and hooks built on them are unaffected.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def pack_parameters(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Copy `params` (one dtype and device) into one new buffer, in order, and point each at
    its slice; returns the buffer."""
    if not params:
        raise ValueError("pack_parameters: no parameters")
    dtypes = {(p.dtype, p.device) for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"pack_parameters: parameters span several dtypes/devices {sorted(map(str, dtypes))}")
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    pos = 0
    for p in params:
        n = p.numel()
        dst = flat[pos:pos + n].view(p.shape)
        dst.copy_(p.data)
        p.data = dst
        pos += n
    return flat
