"""Off-policy correction between the rollout engine's log-probs and the trainer's: truncated importance weights and rejection masks."""

from __future__ import annotations

import torch

from raytool.algos.losses import _masked_mean

CORRECTION_MODES = ("token", "sequence")
CORRECTION_METRICS = ("rollout_corr/is_mean", "rollout_corr/is_truncated_frac", "rollout_corr/rs_masked_frac", "rollout_corr/mismatch_kl",
                      "rollout_corr/mismatch_k1")  # what rollout_correction reports, in this order


def rollout_correction(
    prox_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rs_upper: float = 2.0,
    rs_lower: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights and rejection mask for tokens sampled by the engine (mu) but trained against pi_prox; inputs [B,T].

    Decoupled PPO (AReaL, Fu et al. 2025) clips around pi_prox, the trainer's policy before the update;
    the tokens were sampled from mu, the engine's (stale weights, other kernels), so each is reweighted:
      log r_t = prox_logp_t - rollout_logp_t                 (r = pi_prox / mu)
      token IS:     w_t = min(r_t, C)
      sequence IS:  w_t = min(exp(sum_s log r_s), C)         every token of the sequence, s over its mask tokens
    Cutting w at C = is_threshold bounds the variance for a little bias (truncated IS, Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training").
    Rejection drops what reweighting cannot save: token RS zeroes the mask where r_t leaves
    [rs_lower, rs_upper]; sequence RS zeroes a whole sequence whose exp(sum_s log r_s) leaves it.
    rs_lower None means 1 / rs_upper. A mode of None turns that part off (weights 1, mask unchanged).

    Returns (weights [B,T] float32 detached, 1 where mask is 0; mask [B,T] with rejected tokens
    zeroed; metrics), metrics detached 0-d tensors over the input mask's tokens:
      rollout_corr/is_mean            mean of the truncated weights
      rollout_corr/is_truncated_frac  share of tokens whose weight was cut to C
      rollout_corr/rs_masked_frac     share of tokens the rejection masked
      rollout_corr/mismatch_kl        k3 = r - 1 - log r, estimates KL(mu || pi_prox)
      rollout_corr/mismatch_k1        rollout_logp - prox_logp
    """
    for name, mode in (("rollout_is", rollout_is), ("rollout_rs", rollout_rs)):
        if mode is not None and mode not in CORRECTION_MODES:
            raise ValueError(f"{name} must be one of {list(CORRECTION_MODES)} or None, got {mode!r} ('auto' is resolved by the caller)")
    if rollout_is is not None and is_threshold <= 1.0:
        raise ValueError(f"rollout_is_threshold must be > 1 (importance weights above it are cut to it), got {is_threshold}")
    lower = 1.0 / rs_upper if rs_lower is None else rs_lower
    if rollout_rs is not None and not 0.0 < lower <= 1.0 <= rs_upper:
        raise ValueError(f"rollout rejection needs 0 < rollout_rs_threshold_lower <= 1 <= rollout_rs_threshold, got lower={lower}, upper={rs_upper}")

    keep = mask.bool()
    # float32: sequence sums of bf16 log-ratios lose the precision that decides rejection.
    # torch.where, not * mask: positions outside the mask may hold inf or nan.
    log_r = torch.where(keep, (prox_logp.detach() - rollout_logp.detach()).float(), 0.0)
    seq_log_r = log_r.sum(-1, keepdim=True).expand_as(log_r)
    # exp overflows float32 past ~88; +-20 is far beyond any threshold, so nothing a bound decides changes.
    token_ratio = torch.exp(log_r.clamp(-20.0, 20.0))
    seq_ratio = torch.exp(seq_log_r.clamp(-20.0, 20.0))

    weights = torch.ones_like(log_r)
    truncated = torch.zeros_like(keep)
    if rollout_is is not None:
        raw = token_ratio if rollout_is == "token" else seq_ratio
        truncated = keep & (raw > is_threshold)
        weights = torch.where(keep, raw.clamp(max=is_threshold), 1.0)

    new_mask = mask
    rejected = torch.zeros_like(keep)
    if rollout_rs is not None:
        ratio = token_ratio if rollout_rs == "token" else seq_ratio
        rejected = keep & ((ratio < lower) | (ratio > rs_upper))
        new_mask = torch.where(rejected, torch.zeros_like(mask), mask)

    values = (weights, truncated.float(), rejected.float(), token_ratio - 1.0 - log_r.clamp(-20.0, 20.0), -log_r)
    metrics = {name: _masked_mean(value, mask) for name, value in zip(CORRECTION_METRICS, values)}
    return weights, new_mask, metrics
