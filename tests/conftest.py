"""Shared pytest fixtures: per-test temp dirs and owned child processes."""
