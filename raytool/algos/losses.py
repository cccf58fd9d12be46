"""Policy losses: `(logp [B,T], old_logp [B,T], adv [B,T], mask [B,T], cfg) -> (loss, metrics)`."""

from __future__ import annotations

import torch

POLICY_LOSSES: dict = {}


def register(name: str):
    def wrap(fn):
        POLICY_LOSSES[name] = fn
        return fn

    return wrap


def get_policy_loss(name: str):
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss '{name}'; registered: {sorted(POLICY_LOSSES)}") from None


def masked_aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: float | None = None) -> torch.Tensor:
    """Reduce per-token values [B,T] to a scalar.

    token-mean: sum over all tokens / number of tokens (DAPO); `num_tokens` overrides the count so
    that micro-batches of one mini-batch add up to the mini-batch's token mean.
    seq-mean-token-mean: mean over tokens within a sequence, then over sequences (GRPO paper).
    seq-mean-token-sum: sum within a sequence, then mean over sequences (Dr. GRPO).
    """
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        denom = num_tokens if num_tokens is not None else mask.sum().clamp(min=1.0)
        return (values * mask).sum() / denom
    per_seq_sum = (values * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        return (per_seq_sum / mask.sum(-1).clamp(min=1.0)).mean()
    if mode == "seq-mean-token-sum":
        return per_seq_sum.mean()
    raise ValueError(f"unknown loss aggregation '{mode}'")


@register("ppo_clip")
def ppo_clip(logp, old_logp, adv, mask, *, clip_low=0.2, clip_high=0.28, agg="token-mean", num_tokens=None):
    """PPO-clip (Schulman et al. 2017) with DAPO's decoupled clip range (Yu et al. 2025).

    ratio = exp(logp - old_logp);  L = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    loss = masked_aggregate(per_token, mask, agg, num_tokens)
    with torch.no_grad():
        m = mask.bool()
        clip_frac = ((clipped < unclipped).float()[m]).mean() if m.any() else torch.tensor(0.0)
        approx_kl = (0.5 * (logp - old_logp) ** 2)[m].mean() if m.any() else torch.tensor(0.0)
    return loss, {"actor/clip_frac": clip_frac.item(), "actor/approx_kl": approx_kl.item()}


# A token with advantage 0 adds exactly 0 to this loss and its gradient, so the trainer may skip
# zero-advantage sequences (e.g. GRPO groups whose samples all got the same reward).
ppo_clip.zero_advantage_is_noop = True
