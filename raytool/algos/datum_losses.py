"""Losses over a caller's own per-token inputs (the Tinker API's built-in losses): each datum brings
its target tokens and whatever the loss reads (weights, the sampler's log-probs, advantages), one
value per position. Every loss is a SUM over positions (not a mean: the caller's weights and
advantages carry any normalisation), so that gradients of several `forward_backward` calls add up.

`fn(logp [B,T], inputs {name: [B,T]}, mask [B,T], **config) -> (loss, metrics)`: logp is the
policy's log-prob of each target token, mask is 1 on the datum's own positions (0 on padding).
`fn.inputs` names the per-position inputs it needs, `fn.config` the config keys it takes with their
defaults: a request is checked against both before anything runs. `fn.fill`: the value of an
optional input for a datum that leaves it out while others of its batch give it.
"""

from __future__ import annotations

import torch

from raytool.algos.registry import Registry

DATUM_LOSSES = Registry("loss")
register = DATUM_LOSSES.register
get_datum_loss = DATUM_LOSSES.lookup


def _summed(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), per_token, 0.0).sum()


def _ratio(logp: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    # float32 exp overflows past ~88: an inf ratio would turn a clipped branch's zero gradient into nan
    return torch.exp((logp - sampled).clamp(-20.0, 20.0))


def _bounds(inputs: dict, low: float, high: float) -> tuple:
    """The ratio's clip bounds: per position where the datum brings them, else the config's."""
    return inputs.get("clip_low_threshold", low), inputs.get("clip_high_threshold", high)


@register("cross_entropy")
def cross_entropy(logp, inputs, mask):
    """Supervised learning: loss = sum_t -logp_t * weights_t (weights default to 1 where absent)."""
    weights = inputs.get("weights")
    nll = -logp if weights is None else -logp * weights
    return _summed(nll, mask), {}


cross_entropy.inputs = ()
cross_entropy.fill = {"weights": 1.0}
cross_entropy.config = {}


@register("importance_sampling")
def importance_sampling(logp, inputs, mask):
    """REINFORCE with an importance weight for the sampler (off-policy by the sampler's numerics or
    by staleness): loss = -sum_t exp(logp_t - logprobs_t) * advantages_t, where `logprobs` are the
    sampler's log-probs of the target tokens."""
    return _summed(-_ratio(logp, inputs["logprobs"]) * inputs["advantages"], mask), {}


importance_sampling.inputs = ("logprobs", "advantages")
importance_sampling.fill = {}
importance_sampling.config = {}


@register("ppo")
def ppo(logp, inputs, mask, clip_low_threshold=0.8, clip_high_threshold=1.2):
    """PPO's clipped objective (Schulman et al. 2017) with the ratio bounds given directly:
    r = exp(logp - logprobs), loss = -sum_t min(r A, clip(r, low, high) A). The bounds are config
    keys `clip_low_threshold` / `clip_high_threshold` (default 0.8 / 1.2), or per-position inputs of
    those names."""
    ratio = _ratio(logp, inputs["logprobs"])
    adv = inputs["advantages"]
    low, high = _bounds(inputs, clip_low_threshold, clip_high_threshold)
    clipped = torch.minimum(torch.maximum(ratio, torch.as_tensor(low, dtype=ratio.dtype)), torch.as_tensor(high, dtype=ratio.dtype))
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    keep = mask.bool()
    clip_frac = ((clipped != ratio) & keep).sum() / keep.sum().clamp(min=1)
    return _summed(per_token, mask), {"clip_fraction": clip_frac.detach()}


ppo.inputs = ("logprobs", "advantages")
ppo.fill = {}
ppo.config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


@register("cispo")
def cispo(logp, inputs, mask, clip_low_threshold=0.8, clip_high_threshold=1.2):
    """CISPO (MiniMax-M1, 2025): the importance weight is clipped and detached, every token keeps
    its gradient: loss = -sum_t sg(clip(r_t, low, high)) * A_t * logp_t."""
    ratio = _ratio(logp, inputs["logprobs"])
    low, high = _bounds(inputs, clip_low_threshold, clip_high_threshold)
    weight = torch.minimum(torch.maximum(ratio, torch.as_tensor(low, dtype=ratio.dtype)), torch.as_tensor(high, dtype=ratio.dtype)).detach()
    return _summed(-weight * inputs["advantages"] * logp, mask), {}


cispo.inputs = ("logprobs", "advantages")
cispo.fill = {}
cispo.config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


@register("dro")
def dro(logp, inputs, mask, beta=None):
    """Direct reward optimisation with a quadratic penalty on the policy's drift from the sampler
    (Richemond et al. 2025): loss = -sum_t (A_t logp_t - beta/2 (logp_t - logprobs_t)^2). `beta` is
    a required config key."""
    if beta is None:
        raise ValueError("loss 'dro' needs loss_fn_config['beta'], the weight of its quadratic penalty")
    drift = logp - inputs["logprobs"]
    return _summed(-(inputs["advantages"] * logp - 0.5 * float(beta) * drift * drift), mask), {}


dro.inputs = ("logprobs", "advantages")
dro.fill = {}
dro.config = {"beta": None}
