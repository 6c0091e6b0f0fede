"""On-policy distillation: the student samples, a teacher scores the same tokens.

The teacher is another HF checkpoint with the same vocabulary, held by the trainer as a
frozen, sharded no-grad model (like the KL reference) and run over each micro-batch.
Each response token's advantage is the negated per-token reverse-KL estimate

    A_t = -kl_coef * (log pi_student(y_t) - log pi_teacher(y_t)) + reward_coef * A_task_t

so the policy-gradient loss pushes the student's sampled tokens toward where the teacher
puts mass (per-token, undiscounted), optionally alongside the task reward's advantage.
The student logprob is the step's old-policy logprob (recomputed or the engine's).
"""

from __future__ import annotations

import torch

from miles.core.errors import ConfigError
from miles.core.schema.trainer import DistillConfig
from miles.models.config import ModelSpec
from miles.models.decoder import CausalLM
from miles.models.hf_io import load_model


def load_teacher(cfg: DistillConfig, student: ModelSpec) -> CausalLM:
    """The teacher model (fp32, CPU, frozen); its vocabulary must equal the student's."""
    teacher = load_model(cfg.teacher_checkpoint, dtype=torch.float32)
    if teacher.spec.vocab_size != student.vocab_size:
        raise ConfigError(
            f"trainer.distill.teacher_checkpoint={cfg.teacher_checkpoint!r}: teacher vocab_size "
            f"{teacher.spec.vocab_size} != student vocab_size {student.vocab_size}"
        )
    teacher.requires_grad_(False)
    return teacher


def distill_advantages(
    student_logp: list[torch.Tensor],
    teacher_logp: list[torch.Tensor],
    task_adv: list[torch.Tensor],
    cfg: DistillConfig,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(per-token advantages, per-token reverse-KL estimates) for each sample."""
    advs, kls = [], []
    for s, t, a in zip(student_logp, teacher_logp, task_adv, strict=True):
        kl = s.float() - t.float()
        kls.append(kl)
        adv = -cfg.kl_coef * kl
        if cfg.reward_coef:
            adv = adv + cfg.reward_coef * a
        advs.append(adv)
    return advs, kls
