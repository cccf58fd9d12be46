import math

import torch

from raytool.algos import get_adv_estimator, get_policy_loss, masked_aggregate


def test_grpo_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 1.0, 1.0])
    groups = ["a", "a", "a", "b", "c", "c"]
    adv = get_adv_estimator("grpo")(rewards, groups)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0]
    expected = [(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std, 0.0, 0.0, 0.0]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-5)
    dr = get_adv_estimator("grpo")(rewards, groups, norm_by_std=False)
    assert torch.allclose(dr[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3]))


def test_ppo_clip_loss_and_gradient_hand_computed():
    ratio = torch.tensor([[1.5, 0.5, 1.0, 0.5, 3.0]])
    logp = ratio.log().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, metrics = get_policy_loss("ppo_clip")(logp, torch.zeros_like(logp), adv, mask, clip_low=0.2, clip_high=0.28)
    # per token -min(rA, clip(r)A): -1.28, -0.5, +1.0, +0.8 (masked 5th ignored); token mean over 4
    assert math.isclose(loss.item(), (-1.28 - 0.5 + 1.0 + 0.8) / 4, abs_tol=1e-6)
    assert math.isclose(metrics["actor/clip_frac"], 2 / 4)
    loss.backward()
    # d/dlogp of -rA/N where the unclipped branch is active, 0 where clipped or masked
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5 / 4, 1.0 / 4, 0.0, 0.0]]), atol=1e-6)


def test_loss_aggregations():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert masked_aggregate(values, mask, "token-mean").item() == 10 / 4
    assert masked_aggregate(values, mask, "seq-mean-token-mean").item() == (2 + 4) / 2
    assert masked_aggregate(values, mask, "seq-mean-token-sum").item() == (6 + 4) / 2
    assert masked_aggregate(values, mask, "token-mean", num_tokens=8).item() == 10 / 8
