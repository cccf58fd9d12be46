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


class _ScriptedGraph:
    """Graph.rollout with rewards scripted per round: each row is a list of its samples' rewards."""

    def __init__(self, rounds: list[list[list[float]]]):
        self.rounds = iter(rounds)
        self.prefixes = []

    def rollout(self, rows, prefix, progress=None):
        self.prefixes.append(prefix)
        groups = next(self.rounds)
        assert len(groups) == len(rows)
        stats = [{**_STAT, "reward": r, "acc": r, "group": g, "row": row} for g, (row, rewards) in enumerate(zip(rows, groups)) for r in rewards]
        return stats, [f"{prefix}-ref{g}" for g in range(len(groups))]


_STAT = {"response_length": 10, "generated_tokens": 10, "num_turns": 1, "tool_calls": 0, "tool_errors": 0, "finish_reason": "answer"}


def _cfg(dynamic: bool, rounds: int = 3):
    from raytool.config import load_config

    return load_config(None, ["data.prompts_per_step=2", "rollout.n=2", f"algorithm.dynamic_sampling={str(dynamic).lower()}",
                              f"algorithm.max_sampling_rounds={rounds}"])


def test_dynamic_sampling_keeps_groups_with_a_reward_spread_until_the_batch_is_full():
    from actors.pipeline import collect_rollouts
    from raytool.data import PromptLoader

    loader = PromptLoader(["p0", "p1", "p2", "p3", "p4", "p5"], 2, seed=0)
    graph = _ScriptedGraph([[[1.0, 1.0], [0.0, 1.0]], [[0.0, 0.0], [1.0, 0.0]]])
    stats, refs, metrics = collect_rollouts(graph, _cfg(True), loader, step=5)
    assert refs == ["s5r1g-ref1", "s5r2g-ref1"]  # the second group of each round; the all-equal ones are dropped
    assert sorted({s["group"] for s in stats}) == [0, 1] and len(stats) == 4  # re-indexed to the kept refs
    assert [s["reward"] for s in stats if s["group"] == 1] == [1.0, 0.0]
    assert metrics["rollout/sampling_rounds"] == 2 and metrics["rollout/prompts_drawn"] == 4 and metrics["rollout/groups_kept"] == 2
    assert metrics["reward/mean"] == 0.5  # over everything rolled out, before the filter


def test_dynamic_sampling_stops_at_the_round_cap_and_without_it_everything_trains():
    from actors.pipeline import collect_rollouts
    from raytool.data import PromptLoader

    loader = PromptLoader(list(range(10)), 2, seed=0)
    flat = [[0.0, 0.0], [0.0, 0.0]]
    stats, refs, metrics = collect_rollouts(_ScriptedGraph([flat, flat]), _cfg(True, rounds=2), loader, step=1)
    assert metrics["rollout/sampling_rounds"] == 2 and metrics["rollout/groups_kept"] == 0
    assert refs == ["s1r2g-ref0", "s1r2g-ref1"]  # nothing to learn from: the last round, whose advantages are all zero
    stats, refs, metrics = collect_rollouts(_ScriptedGraph([flat]), _cfg(False), loader, step=2)
    assert len(refs) == 2 and "rollout/sampling_rounds" not in metrics
