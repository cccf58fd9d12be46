import math

import pytest
import torch

from raytool.algos import get_policy_loss
from raytool.algos.correction import rollout_correction


def _logps(ratios):
    """(prox_logp, rollout_logp) whose ratio exp(prox - rollout) is `ratios` [B,T]; rollout is a fixed offset."""
    rollout = torch.full((len(ratios), len(ratios[0])), -1.0)
    return rollout + torch.tensor(ratios).log(), rollout


def test_token_is_weights_truncated_at_threshold():
    prox, rollout = _logps([[0.5, 1.5, 3.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights, new_mask, metrics = rollout_correction(prox, rollout, mask, rollout_is="token", is_threshold=2.0)
    assert torch.allclose(weights, torch.tensor([[0.5, 1.5, 2.0, 1.0]]), atol=1e-6)  # padding: 1
    assert torch.equal(new_mask, mask)
    assert math.isclose(float(metrics["rollout_corr/is_mean"]), (0.5 + 1.5 + 2.0) / 3, abs_tol=1e-6)
    assert math.isclose(float(metrics["rollout_corr/is_truncated_frac"]), 1 / 3, abs_tol=1e-6)
    assert float(metrics["rollout_corr/rs_masked_frac"]) == 0.0


def test_sequence_is_weight_is_product_over_masked_tokens_truncated():
    # row 0: 2 * 0.75 = 1.5 (the masked 5.0 is not part of it); row 1: 2 * 2 * 2 = 8 -> cut to 3
    prox, rollout = _logps([[2.0, 0.75, 5.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    weights, new_mask, metrics = rollout_correction(prox, rollout, mask, rollout_is="sequence", is_threshold=3.0)
    assert torch.allclose(weights, torch.tensor([[1.5, 1.5, 1.0], [3.0, 3.0, 3.0]]), atol=1e-5)
    assert torch.equal(new_mask, mask)
    assert math.isclose(float(metrics["rollout_corr/is_mean"]), (2 * 1.5 + 3 * 3.0) / 5, abs_tol=1e-5)
    assert math.isclose(float(metrics["rollout_corr/is_truncated_frac"]), 3 / 5, abs_tol=1e-6)


def test_token_rejection_masks_tokens_outside_bounds():
    prox, rollout = _logps([[0.5, 0.9, 1.2, 1.5, 0.1]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    weights, new_mask, metrics = rollout_correction(prox, rollout, mask, rollout_rs="token", rs_upper=1.25, rs_lower=0.8)
    assert torch.equal(new_mask, torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0]]))
    assert torch.equal(weights, torch.ones_like(weights))  # IS off
    assert math.isclose(float(metrics["rollout_corr/rs_masked_frac"]), 2 / 4)
    assert float(metrics["rollout_corr/is_mean"]) == 1.0
    assert float(metrics["rollout_corr/is_truncated_frac"]) == 0.0


def test_sequence_rejection_masks_whole_sequences():
    # sequence ratios: 2 * 0.75 = 1.5 (kept), 2 * 4 = 8 (above 3), 0.5 * 0.5 = 0.25 (below 0.5)
    prox, rollout = _logps([[2.0, 0.75, 100.0], [2.0, 4.0, 1.0], [0.5, 0.5, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    _, new_mask, metrics = rollout_correction(prox, rollout, mask, rollout_rs="sequence", rs_upper=3.0, rs_lower=0.5)
    assert torch.equal(new_mask, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert math.isclose(float(metrics["rollout_corr/rs_masked_frac"]), 5 / 7, abs_tol=1e-6)


def test_rejection_lower_bound_defaults_to_inverse_upper():
    prox, rollout = _logps([[0.2, 0.3, 1.0, 3.9, 4.1]])
    mask = torch.ones(1, 5)
    _, new_mask, _ = rollout_correction(prox, rollout, mask, rollout_rs="token", rs_upper=4.0)
    # lower = 1/4: 0.2 and 4.1 leave [0.25, 4]
    assert torch.equal(new_mask, torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]]))


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_inf_and_nan_outside_the_mask_do_not_leak(mode):
    prox, rollout = _logps([[1.5, 0.9, 1.0, 1.0], [3.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    clean = rollout_correction(prox, rollout, mask, rollout_is=mode, rollout_rs=mode, rs_upper=2.5)
    bad_prox, bad_rollout = prox.clone(), rollout.clone()
    bad_prox[0, 2], bad_rollout[0, 3] = float("inf"), float("nan")
    bad_prox[1, 1:], bad_rollout[1, 1:] = float("nan"), float("-inf")
    weights, new_mask, metrics = rollout_correction(bad_prox, bad_rollout, mask, rollout_is=mode, rollout_rs=mode, rs_upper=2.5)
    assert torch.isfinite(weights).all()
    assert torch.equal(weights, clean[0])
    assert torch.equal(new_mask, clean[1])
    assert new_mask[1, 0] == 0.0  # 3.0 > 2.5 rejected, in both modes
    for key, value in metrics.items():
        assert torch.isfinite(value) and torch.equal(value, clean[2][key]), key


def test_mismatch_kl_metrics_hand_computed():
    prox, rollout = _logps([[2.0, 4.0, 1e6]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    prox.requires_grad_(True)
    weights, _, metrics = rollout_correction(prox, rollout, mask)
    # k3 = r - 1 - log r: (1 - ln 2) + (3 - ln 4);  k1 = -log r: -ln 2 - ln 4
    assert math.isclose(float(metrics["rollout_corr/mismatch_kl"]), (4 - 3 * math.log(2)) / 2, abs_tol=1e-5)
    assert math.isclose(float(metrics["rollout_corr/mismatch_k1"]), -3 * math.log(2) / 2, abs_tol=1e-5)
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())
    assert not weights.requires_grad


def test_bad_modes_and_thresholds_raise():
    prox, rollout = _logps([[1.0]])
    mask = torch.ones(1, 1)
    with pytest.raises(ValueError, match="rollout_is"):
        rollout_correction(prox, rollout, mask, rollout_is="auto")
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        rollout_correction(prox, rollout, mask, rollout_is="token", is_threshold=0.5)
    with pytest.raises(ValueError, match="lower"):
        rollout_correction(prox, rollout, mask, rollout_rs="token", rs_upper=2.0, rs_lower=1.5)


def _ppo_grad(**opts):
    logp = torch.zeros(1, 3, requires_grad=True)  # ratio 1: inside the clip range, gradient -A/N
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    old = torch.tensor([[0.1, -0.05, 0.0]])
    loss, _ = get_policy_loss("ppo_clip")(logp, old, adv, torch.ones(1, 3), **opts)
    loss.backward()
    return loss.detach(), logp.grad


def test_ppo_clip_weights_none_is_bit_identical():
    loss, grad = _ppo_grad()
    for opts in ({"weights": None}, {"weights": torch.ones(1, 3)}):
        loss_w, grad_w = _ppo_grad(**opts)
        assert torch.equal(loss_w, loss) and torch.equal(grad_w, grad)


def test_ppo_clip_weight_scales_that_tokens_gradient():
    _, grad = _ppo_grad()
    _, grad_w = _ppo_grad(weights=torch.tensor([[1.0, 0.5, 1.0]]))
    assert grad[0, 1] != 0.0
    assert torch.allclose(grad_w, grad * torch.tensor([[1.0, 0.5, 1.0]]), atol=0.0, rtol=1e-6)


def test_correction_weights_and_mask_feed_ppo_clip_with_garbage_padding():
    prox, rollout = _logps([[1.5, 3.0, 1.0]])
    prox[0, 2] = float("inf")
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights, new_mask, _ = rollout_correction(prox, rollout, mask, rollout_is="token", is_threshold=2.0)
    logp = prox.detach().clone()
    logp[0, 2] = 0.0
    logp.requires_grad_(True)
    loss, _ = get_policy_loss("ppo_clip")(logp, prox.detach(), torch.ones(1, 3), new_mask, weights=weights)
    loss.backward()
    # ratio 1 against prox: per token -A * w; token mean over 2
    assert math.isclose(loss.item(), -(1.5 + 2.0) / 2, abs_tol=1e-5)
    assert torch.isfinite(logp.grad).all()
    assert torch.allclose(logp.grad, torch.tensor([[-1.5 / 2, -2.0 / 2, 0.0]]), atol=1e-5)
