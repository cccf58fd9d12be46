"""`raytool bench trl`'s parts that need neither TRL nor Ray: the shared work's config, the reward
TRL is given, and the report from per-step figures. The bench itself (TRL installed, a graph
running) is measured by hand: docs/benchmarks.md."""

import pytest

from raytool.config import load_config


def test_the_work_both_do_is_one_turn_the_boxed_reward_no_kl_and_one_update():
    from actors.benches.trl import same_work

    cfg = same_work(load_config(None, ["algorithm.kl_loss_coef=0.1", "algorithm.ppo_epochs=2", "trainer.sft_warmup_steps=3"]), 48)
    assert (cfg.agent.max_turns, cfg.agent.max_response_tokens, cfg.rollout.max_tokens_per_turn, cfg.rollout.top_p) == (1, 48, 48, 1.0)
    assert cfg.reward.fn.endswith("actors/benches/trl.py:raytool_reward")
    assert (cfg.algorithm.kl_loss_coef, cfg.algorithm.ppo_epochs, cfg.algorithm.mini_batches) == (0.0, 1, 1)
    assert cfg.trainer.sft_warmup_steps == 0 and cfg.async_.max_staleness == 0


def test_trl_and_raytool_score_a_completion_alike():
    from actors.benches.trl import raytool_reward, trl_reward

    completions = [[{"role": "assistant", "content": "so \\boxed{42}"}], [{"role": "assistant", "content": "\\boxed{41}"}], "no answer", "1234567890 12"]
    truths = ["42", "42", "7", "7"]
    assert trl_reward(completions, truths, prompts=None) == pytest.approx([1.02, 0.02, 0.0, 0.1])
    assert [raytool_reward({"response": c[-1]["content"] if isinstance(c, list) else c}, t, {}) for c, t in zip(completions, truths)] == (
        trl_reward(completions, truths))


def test_the_report_times_the_steps_after_the_warm_up_and_compares_them():
    from actors.benches.trl import report

    def ours(step_s, tokens):
        return {"timing/step_s": step_s, "timing/train_s": step_s / 2, "timing/rollout_s": step_s / 4, "perf/update_tokens": tokens,
                "perf/update_row_tokens": tokens / 2, "perf/update_row_tokens_unshared": tokens}

    table, result = report(load_config(None, []), [ours(30.0, 1000), ours(4.0, 1000), ours(6.0, 1000)], [50.0, 10.0, 10.0],
                           [1200.0, 2400.0, 3600.0], bf16=False)
    assert result["raytool_vs_trl"] == pytest.approx(0.5) and result["steps_timed"] == 2
    assert result["trl_tokens_per_s"] == pytest.approx(120.0) and result["raytool_tokens_per_s"] == pytest.approx(200.0)
    assert result["shared_vs_unshared_tokens"] == pytest.approx(0.5) and "raytool_vs_trl 0.50" in table
    with pytest.raises(Exception, match="fewer than two steps"):
        report(load_config(None, []), [ours(1.0, 10)], [1.0], [10.0], bf16=False)
