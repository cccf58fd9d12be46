from actors.pipeline import rollout_metrics


def test_rollout_metrics_from_trajectory_stats():
    stats = [
        {"reward": 1.0, "acc": 1.0, "response_length": 40, "generated_tokens": 30, "num_turns": 2, "tool_calls": 1, "tool_errors": 0, "finish_reason": "answer"},
        {"reward": 0.0, "acc": 0.0, "response_length": 80, "generated_tokens": 50, "num_turns": 3, "tool_calls": 3, "tool_errors": 2, "finish_reason": "max_turns"},
    ]
    m = rollout_metrics(stats)
    assert m["reward/mean"] == 0.5 and m["response_length/mean"] == 60 and m["num_turns/mean"] == 2.5
    assert m["tool/calls_per_traj"] == 2.0 and m["tool/error_rate"] == 0.5
    assert m["finish/answer"] == 0.5 and m["finish/max_turns"] == 0.5
    assert rollout_metrics([{**stats[0], "tool_calls": 0}])["tool/error_rate"] == 0.0
