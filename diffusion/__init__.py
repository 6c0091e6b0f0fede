"""Diffusion RL: a small flow-matching image policy, an SDE rollout engine that records each
denoising transition's log-probability, and a GRPO trainer over denoising trajectories."""
