"""Advantage estimators: `(rewards [B], group_ids [B], **opts) -> advantages [B]` (one per sequence)."""

from __future__ import annotations

import torch

ADV_ESTIMATORS: dict = {}


def register(name: str):
    def wrap(fn):
        ADV_ESTIMATORS[name] = fn
        return fn

    return wrap


def get_adv_estimator(name: str):
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator '{name}'; registered: {sorted(ADV_ESTIMATORS)}") from None


@register("grpo")
def grpo(rewards: torch.Tensor, group_ids: list, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean(r_group)) / (std(r_group) + eps).

    std is the unbiased sample std (torch default); a group of one has advantage 0. With
    norm_by_std=False this is Dr. GRPO's (Liu et al. 2025) unscaled r_i - mean.
    """
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    index: dict = {}
    for i, g in enumerate(group_ids):
        index.setdefault(g, []).append(i)
    for members in index.values():
        idx = torch.tensor(members)
        r = rewards[idx].float()
        if len(members) == 1:
            continue
        centered = r - r.mean()
        adv[idx] = centered / (r.std() + eps) if norm_by_std else centered
    return adv
