"""Advantage estimators: `(rewards [B], group_ids [B], *, norm_by_std, eps) -> advantages [B]` (one per sequence)."""

from __future__ import annotations

import torch

from raytool.algos.registry import Registry

ADV_ESTIMATORS = Registry("advantage estimator")
register = ADV_ESTIMATORS.register
get_adv_estimator = ADV_ESTIMATORS.lookup


def _groups(group_ids: list) -> list[torch.Tensor]:
    """Row indices of each group, in order of first appearance."""
    index: dict = {}
    for i, g in enumerate(group_ids):
        index.setdefault(g, []).append(i)
    return [torch.tensor(members) for members in index.values()]


@register("grpo")
def grpo(rewards: torch.Tensor, group_ids: list, *, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean(r_group)) / (std(r_group) + eps); r, A [B].

    std is the unbiased sample std (torch default); a group of one has advantage 0. With
    norm_by_std=False this is Dr. GRPO's (Liu et al. 2025) unscaled r_i - mean.
    """
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for idx in _groups(group_ids):
        if len(idx) == 1:
            continue
        r = rewards[idx].float()
        centered = r - r.mean()
        adv[idx] = centered / (r.std() + eps) if norm_by_std else centered
    return adv


@register("rloo")
def rloo(rewards: torch.Tensor, group_ids: list, *, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, Back to Basics): A_i = r_i - mean_{j != i}(r_j) over the group; r, A [B].

    The leave-one-out baseline is already unbiased and unscaled, so `norm_by_std` and `eps` are
    accepted (the trainer passes them to every estimator) and ignored. A group of one has no
    other sample to compare with and gets advantage 0.
    """
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for idx in _groups(group_ids):
        n = len(idx)
        if n == 1:
            continue
        r = rewards[idx].float()
        adv[idx] = r - (r.sum() - r) / (n - 1)
    return adv
