"""Rollout engines behind one contract (`base.Engine`): `torch` (embedded) and `sglang` (external)."""
