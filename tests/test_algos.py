import math

import pytest
import torch

from raytool.algos import entropy_from_logits, get_adv_estimator, get_policy_loss, kl_penalty, masked_aggregate


def test_grpo_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 1.0, 1.0])
    groups = ["a", "a", "a", "b", "c", "c"]
    adv = get_adv_estimator("grpo")(rewards, groups)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0]
    expected = [(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std, 0.0, 0.0, 0.0]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-5)
    dr = get_adv_estimator("grpo")(rewards, groups, norm_by_std=False)
    assert torch.allclose(dr[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3]))


def test_rloo_advantages_leave_one_out():
    rewards = torch.tensor([1.0, 0.5, 0.0, 1.0, 0.0, 0.0])
    groups = ["a", "b", "a", "c", "a", "c"]  # interleaved; "b" is a group of one
    adv = get_adv_estimator("rloo")(rewards, groups)
    # a: [1, 0, 0] -> 1 - 0, 0 - 1/2, 0 - 1/2;  b: 0;  c: [1, 0] -> 1 - 0, 0 - 1
    assert torch.allclose(adv, torch.tensor([1.0, 0.0, -0.5, 1.0, -0.5, -1.0]))
    assert torch.equal(get_adv_estimator("rloo")(rewards, groups, norm_by_std=False), adv)


def test_ppo_clip_loss_and_gradient_hand_computed():
    ratio = torch.tensor([[1.5, 0.5, 1.0, 0.5, 3.0]])
    logp = ratio.log().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, metrics = get_policy_loss("ppo_clip")(logp, torch.zeros_like(logp), adv, mask, clip_low=0.2, clip_high=0.28)
    # per token -min(rA, clip(r)A): -1.28, -0.5, +1.0, +0.8 (masked 5th ignored); token mean over 4
    assert math.isclose(loss.item(), (-1.28 - 0.5 + 1.0 + 0.8) / 4, abs_tol=1e-6)
    # upper clip on token 1 (r=1.5, A>0), lower clip on token 4 (r=0.5, A<0)
    assert math.isclose(float(metrics["actor/pg_clipfrac"]), 2 / 4)
    assert float(metrics["actor/pg_clipfrac_lower"]) == 0.0
    loss.backward()
    # d/dlogp of -rA/N where the unclipped branch is active, 0 where clipped or masked
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5 / 4, 1.0 / 4, 0.0, 0.0]]), atol=1e-6)


def test_dual_clip_bounds_negative_advantage_token_with_huge_ratio():
    ratio = torch.tensor([[10.0, 0.5, 1.5, 1.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0]])
    mask = torch.ones_like(ratio)
    logp = ratio.log().requires_grad_(True)
    old = torch.zeros_like(logp)
    loss, metrics = get_policy_loss("ppo_clip")(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    # per token: min(max(10, 1.28), 3 * 1) = 3;  0.8 (lower clip);  -1.28 (upper clip);  2 (unclipped)
    assert math.isclose(loss.item(), (3.0 + 0.8 - 1.28 + 2.0) / 4, abs_tol=1e-6)
    assert math.isclose(float(metrics["actor/pg_clipfrac"]), 2 / 4)
    assert math.isclose(float(metrics["actor/pg_clipfrac_lower"]), 1 / 4)
    assert math.isclose(float(metrics["actor/ppo_kl"]), -(math.log(10) + math.log(0.5) + math.log(1.5)) / 4, abs_tol=1e-6)
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())
    loss.backward()
    # only the unclipped token 4 moves: d(-A r)/dlogp / 4 = 2 * 1 / 4
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0, 0.0, 0.5]]), atol=1e-6)

    # without dual-clip the first token costs -rA = 10 and pushes with gradient -A r / 4
    logp.grad = None
    loss, metrics = get_policy_loss("ppo_clip")(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=None)
    assert math.isclose(loss.item(), (10.0 + 0.8 - 1.28 + 2.0) / 4, abs_tol=1e-5)
    assert float(metrics["actor/pg_clipfrac_lower"]) == 0.0
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[2.5, 0.0, 0.0, 0.5]]), atol=1e-5)

    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        get_policy_loss("ppo_clip")(logp, old, adv, mask, clip_ratio_c=1.0)


def test_zero_advantage_tokens_add_nothing_even_with_exploded_ratio():
    logp = torch.tensor([[50.0, -50.0, 0.3]], requires_grad=True)  # ratios e^20 (clamped), e^-20, e^0.3
    loss, _ = get_policy_loss("ppo_clip")(logp, torch.zeros_like(logp), torch.zeros_like(logp), torch.ones_like(logp))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp))
    assert get_policy_loss("ppo_clip").zero_advantage_is_noop


INF = float("inf")
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, INF, 0.0], [2.0, 2.0, 0.0], [6.0, -2.0, 9.0]])  # inf sits in padding
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]])  # row sums 6, 4, 4, 4; lengths 3, 1, 2, 2


def test_loss_aggregations_hand_computed():
    assert masked_aggregate(VALUES, MASK, "token-mean").item() == 18 / 8
    assert masked_aggregate(VALUES, MASK, "seq-mean-token-mean").item() == (2 + 4 + 2 + 2) / 4
    assert masked_aggregate(VALUES, MASK, "seq-mean-token-sum").item() == 18 / 4
    assert masked_aggregate(VALUES, MASK, "seq-mean-token-sum-norm", max_len=6).item() == 18 / (4 * 6)
    # global counts (e.g. two ranks with 8 tokens / 4 sequences each)
    assert masked_aggregate(VALUES, MASK, "token-mean", num_tokens=16).item() == 18 / 16
    assert masked_aggregate(VALUES, MASK, "seq-mean-token-mean", num_seqs=8).item() == 10 / 8
    assert masked_aggregate(VALUES, MASK, "seq-mean-token-sum", num_seqs=8).item() == 18 / 8
    assert masked_aggregate(VALUES, MASK, "seq-mean-token-sum-norm", num_seqs=8, max_len=6).item() == 18 / 48


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batches_add_up_to_the_whole_batch(mode):
    whole = masked_aggregate(VALUES, MASK, mode, max_len=6)
    # uneven split; the second micro-batch trimmed to its own width as the trainer pads per micro-batch
    parts = [(VALUES[:1], MASK[:1]), (VALUES[1:, :2], MASK[1:, :2])]
    total = sum(masked_aggregate(v, m, mode, num_tokens=8, num_seqs=4, max_len=6) for v, m in parts)
    assert math.isclose(total.item(), whole.item(), rel_tol=1e-6)


def test_kl_estimators_hand_computed_and_k3_gradient():
    logp = torch.tensor([[math.log(0.5), math.log(0.2), -30.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.6), 0.0]])
    # r = pi_ref / pi = 0.5, 3, e^30 (clamped to e^20)
    k1 = kl_penalty(logp, ref, "k1")
    assert torch.allclose(k1, torch.tensor([[math.log(2), -math.log(3), -30.0]]))
    k2 = kl_penalty(logp, ref, "k2")
    assert torch.allclose(k2, torch.tensor([[0.5 * math.log(2) ** 2, 0.5 * math.log(3) ** 2, 450.0]]))
    k3 = kl_penalty(logp, ref, "k3")
    assert torch.allclose(k3, torch.tensor([[0.5 - 1 + math.log(2), 3 - 1 - math.log(3), 10.0]]), atol=1e-6)
    k3.sum().backward()
    # d k3 / d logp = 1 - r inside the clamps, 0 once k3 is clamped at 10
    assert torch.allclose(logp.grad, torch.tensor([[1 - 0.5, 1 - 3.0, 0.0]]), atol=1e-5)


def test_entropy_from_logits():
    uniform = torch.zeros(2, 3, 7)
    assert torch.allclose(entropy_from_logits(uniform), torch.full((2, 3), math.log(7)))
    assert torch.allclose(entropy_from_logits(uniform + 1000.0), torch.full((2, 3), math.log(7)))  # no exp overflow
    probs = torch.tensor([0.5, 0.25, 0.25])
    assert math.isclose(entropy_from_logits(probs.log()).item(), 1.5 * math.log(2), rel_tol=1e-6)
    peaked = entropy_from_logits(torch.tensor([50.0, 0.0, 0.0, 0.0]))
    assert 0.0 <= peaked.item() < 1e-6
    assert entropy_from_logits(torch.zeros(4, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(ValueError, match=r"'nope'; registered: \['grpo', 'rloo'\]"):
        get_adv_estimator("nope")
    with pytest.raises(ValueError, match=r"registered: \['ppo_clip'\]"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match=r"registered: \['k1', 'k2', 'k3'\]"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "low_var")
    with pytest.raises(ValueError, match="allowed: .*'seq-mean-token-sum-norm'"):
        masked_aggregate(VALUES, MASK, "sum")
    with pytest.raises(ValueError, match="needs max_len"):
        masked_aggregate(VALUES, MASK, "seq-mean-token-sum-norm")
