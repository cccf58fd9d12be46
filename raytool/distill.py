"""On-policy distillation (`distill.teacher`): the student samples, a teacher scores every token the
student sampled, and each trained token's advantage is the negative reverse KL of that token,
-(log p_student - log p_teacher), times `distill.kl_coef`, plus `distill.reward_weight` times the
task reward's advantage. Plain logic, no Ray: the teacher's scores arrive through a data plane
(`DataPlane.score`), the advantage is taken by the trainer (`token_advantages`).

The student's log-probs are the rollout engine's, those of the policy that sampled the tokens, so
the signal is the same in the synchronous and the asynchronous mode; the policy loss and its
off-policy corrections apply to it as to a reward's advantage.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import msgspec

from raytool.config import ConfigError, RunConfig

if TYPE_CHECKING:  # the agent workers import this module in processes that never load torch
    import torch

log = logging.getLogger(__name__)


def teacher_run(cfg: RunConfig) -> RunConfig:
    """The config the teacher's rollout servers are built (and planned, and placed) from: the run's
    rollout settings with the teacher's own count, accelerators and tensor parallelism."""
    r, d = cfg.rollout, cfg.distill
    rollout = msgspec.structs.replace(r, num_servers=d.num_servers, num_gpus=r.num_gpus if d.num_gpus is None else d.num_gpus,
                                      tensor_parallel_size=d.tensor_parallel_size or r.tensor_parallel_size)
    return msgspec.structs.replace(cfg, rollout=rollout)


def teacher_logprobs(prompt_len: int, response_mask: list[int], scores: list[float]) -> list[float]:
    """The teacher's log-probs of a trajectory's response tokens (0.0 on observations), from its
    scores of the whole sequence (aligned with ids[1:]); ValueError saying what is wrong with them."""
    expected = prompt_len + len(response_mask) - 1
    if len(scores) != expected:
        raise ValueError(f"the teacher scored {len(scores)} tokens, expected {expected} (every token after the first)")
    own = scores[prompt_len - 1:]
    bad = next((t for t, (lp, m) in enumerate(zip(own, response_mask)) if m and not math.isfinite(lp)), None)
    if bad is not None:
        raise ValueError(f"the teacher's log-prob of response token {bad} is {own[bad]}")
    return [lp if m else 0.0 for lp, m in zip(own, response_mask)]


def reverse_kl(student: list[float], teacher: list[float], mask: list[int]) -> float | None:
    """The mean over the trained tokens of log p_student - log p_teacher (None: no trained token)."""
    terms = [s - t for s, t, m in zip(student, teacher, mask) if m]
    return sum(terms) / len(terms) if terms else None


def tool_turn_agreement(student: list[float], teacher: list[float], mask: list[int]) -> float | None:
    """On the turns that ended in a tool call (a generated run of tokens followed by an observation),
    the mean over their tokens of min(1, p_teacher / p_student): 1 where the teacher is at least as
    likely as the student to have written each token (None: no such turn)."""
    ends = [t for t in range(len(mask) - 1) if mask[t] and not mask[t + 1]]  # the last token of each turn an observation follows
    if not ends:
        return None
    last = ends[-1]
    terms = [math.exp(min(0.0, te - s)) for s, te, m in zip(student[: last + 1], teacher[: last + 1], mask[: last + 1]) if m]
    return sum(terms) / len(terms)


def token_advantages(seq_adv: torch.Tensor, rollout: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                     kl_coef: float, reward_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] advantages: reward_weight * the sequence's advantage - kl_coef * (log p_student - log
    p_teacher) on trained tokens (0 elsewhere); and the reverse KL of each token ([B, T], 0 off the mask)."""
    kl = (rollout - teacher) * mask
    return (reward_weight * seq_adv - kl_coef * kl) * mask, kl


def check_teacher(cfg: RunConfig, student_tokenizer, source: str = "config") -> str:
    """Before anything starts: the teacher's local path; a teacher that cannot be found, or whose
    tokenizer is not the student's (its log-probs would be of other tokens), is refused in one line
    naming the key."""
    from raytool.models import load_tokenizer, resolve_model

    try:
        teacher_path = resolve_model(cfg.distill.teacher)
    except FileNotFoundError as exc:
        raise ConfigError(f"{source}: config key 'distill.teacher': {exc}") from None
    ours, theirs = student_tokenizer.get_vocab(), load_tokenizer(teacher_path).get_vocab()
    conflicts = sorted(set(theirs.items()) - set(ours.items()), key=lambda kv: kv[1])
    if conflicts:
        raise ConfigError(f"{source}: config key 'distill.teacher': {cfg.distill.teacher}'s tokenizer is not the student's "
                          f"({len(theirs)} tokens against {len(ours)}; {len(conflicts)} of the teacher's differ, first {conflicts[:3]}): "
                          "a teacher scores the student's own token ids, so it must share the student's tokenizer")
    extra = sorted(set(ours) - set(theirs), key=ours.get)
    if extra:  # e.g. Qwen3's <think> and <tool_response> beside a Qwen2.5 teacher: the same ids for every token they share
        log.warning("distill.teacher: %s's tokenizer lacks %d of the student's tokens (%s); the teacher scores those ids with "
                    "embeddings it never trained", cfg.distill.teacher, len(extra), ", ".join(extra[:6]))
    return teacher_path
