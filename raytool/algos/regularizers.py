"""Per-token regularizers: KL to a reference policy (estimators in a registry) and the policy's entropy."""

from __future__ import annotations

import torch

from raytool.algos.registry import Registry

KL_ESTIMATORS = Registry("KL estimator")
register = KL_ESTIMATORS.register
get_kl_estimator = KL_ESTIMATORS.lookup


# Schulman, "Approximating KL Divergence" (2020): with tokens sampled from pi and
# log r = ref_logp - logp, each k estimates KL(pi || pi_ref) per token.


@register("k1")
def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = -log r = logp - ref_logp: unbiased, high variance, can be negative; [B,T] -> [B,T]."""
    return logp - ref_logp


@register("k2")
def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (log r)^2 / 2: biased, low variance, >= 0; [B,T] -> [B,T]."""
    return 0.5 * (logp - ref_logp).square()


@register("k3")
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = (r - 1) - log r: unbiased, low variance, >= 0 (verl's "low_var_kl"); [B,T] -> [B,T].

    log r is clamped to [-20, 20] so exp cannot overflow, and k3 to at most 10 (it is never
    negative); past either clamp the token's gradient is 0. Inside them d k3 / d logp = 1 - r.
    """
    log_r = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-10.0, 10.0)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate `kind` (Schulman 2020, "Approximating KL Divergence"); [B,T] -> [B,T]."""
    return get_kl_estimator(kind)(logp, ref_logp)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy H = logsumexp(z) - sum_v softmax(z)_v z_v of the categorical with logits z; [..., V] -> [...].

    Never forms log p (which underflows to -inf for tiny p); computed in the dtype given, so pass
    float32 chunks. Logits must be finite (a -inf logit gives 0 * -inf = nan).
    """
    # H is shift-invariant; centring keeps logsumexp ~ 0 so large logits lose no precision to cancellation.
    logits = logits - logits.amax(dim=-1, keepdim=True).detach()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
