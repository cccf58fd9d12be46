"""Policy losses: `(logp [B,T], old_logp [B,T], adv [B,T], mask [B,T], **opts) -> (loss, metrics)`, and their aggregation."""

from __future__ import annotations

import torch

from raytool.algos.registry import Registry

POLICY_LOSSES = Registry("policy loss")
register = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.lookup
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def masked_aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce per-token values [B,T] where mask [B,T] is 1 to a scalar.

    token-mean: sum over all tokens / num_tokens (DAPO).
    seq-mean-token-mean: sum_i (sum of row i / len_i) / num_seqs (GRPO paper).
    seq-mean-token-sum: sum_i (sum of row i) / num_seqs.
    seq-mean-token-sum-norm: sum_i (sum of row i) / (num_seqs * max_len) (Dr. GRPO, Liu et al. 2025);
        max_len is a constant (the generation budget), the same for every batch.

    num_tokens / num_seqs default to this batch's counts. Pass the counts of the whole mini-batch
    (all micro-batches, all ranks) and the micro-batches' results add up to the mini-batch's value.
    """
    keep = mask.bool()
    masked = torch.where(keep, values, 0.0)  # not values * mask: padding may hold inf or nan
    if mode == "token-mean":
        denom = num_tokens if num_tokens is not None else keep.sum().clamp(min=1)
        return masked.sum() / denom
    n_seqs = num_seqs if num_seqs is not None else max(values.size(0), 1)
    if mode == "seq-mean-token-mean":
        lengths = keep.sum(-1).clamp(min=1).to(values.dtype)
        return (masked.sum(-1) / lengths).sum() / n_seqs
    if mode == "seq-mean-token-sum":
        return masked.sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        if max_len is None:
            raise ValueError("loss aggregation 'seq-mean-token-sum-norm' needs max_len: the constant token budget (e.g. max response length) Dr. GRPO divides by")
        return masked.sum() / (n_seqs * max_len)
    raise ValueError(f"unknown loss aggregation '{mode}'; allowed: {list(AGG_MODES)}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask tokens as a detached 0-d tensor (0 when the mask is empty)."""
    keep = mask.bool()
    return (torch.where(keep, x, 0.0).sum() / keep.sum().clamp(min=1)).detach()


@register("ppo_clip")
def ppo_clip(
    logp, old_logp, adv, mask, *,
    clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0,
    agg="token-mean", num_tokens=None, num_seqs=None, max_len=None, weights=None,
):
    """PPO-clip (Schulman et al. 2017), decoupled clip range (DAPO, Yu et al. 2025), dual-clip (Ye et al. 2020); inputs [B,T].

    r = exp(logp - old_logp)
    L = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    A < 0:  L = min(L, -c A)   dual-clip: a negative-advantage token whose ratio blew up costs at most c|A|
    clip_ratio_c = c must be > 1; None turns dual-clip off.
    weights [B,T] (detached, finite; e.g. truncated importance weights from algos.correction):
    L is multiplied by them before aggregation; None leaves L as it is.

    Metrics are detached 0-d tensors (means over this micro-batch's mask tokens), so summing them
    over micro-batches never waits on the device:
      actor/pg_clipfrac        share of tokens where the eps_low/eps_high bound sets the loss
      actor/pg_clipfrac_lower  share of tokens where the dual-clip bound c|A| sets the loss
      actor/ppo_kl             mean of old_logp - logp (verl's sign: positive when logp fell)
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip bound on -r*A), got {clip_ratio_c}; use None to turn dual-clip off")
    # float32 exp overflows past ~88; an inf ratio turns the zero gradient of a clipped branch into nan.
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    dual_clipped = torch.zeros_like(clipped)
    if clip_ratio_c is not None:
        loss_dual = -adv * clip_ratio_c
        dual_clipped = (adv < 0) & (per_token > loss_dual)
        per_token = torch.where(adv < 0, torch.minimum(per_token, loss_dual), per_token)
    if weights is not None:
        per_token = per_token * weights
    loss = masked_aggregate(per_token, mask, agg, num_tokens, num_seqs, max_len)
    metrics = {
        "actor/pg_clipfrac": _masked_mean(clipped.to(logp.dtype), mask),
        "actor/pg_clipfrac_lower": _masked_mean(dual_clipped.to(logp.dtype), mask),
        "actor/ppo_kl": _masked_mean(old_logp - logp, mask),
    }
    return loss, metrics


# A token with advantage 0 adds exactly 0 to this loss and its gradient (every branch, the dual-clip
# bound -c*A included, is a multiple of A), so the trainer may skip zero-advantage sequences (e.g.
# GRPO groups whose samples all got the same reward) as long as num_tokens / num_seqs still count them.
ppo_clip.zero_advantage_is_noop = True
ppo_clip.metric_names = ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl")  # what it reports: the trainer reduces these names on every rank
