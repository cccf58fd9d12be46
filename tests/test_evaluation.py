import pytest

from raytool.evaluation import EvalSample, majority_correct, summarize, table


def _s(source, prompt, acc, answer, calls=1, errors=0, turns=2, length=50):
    return EvalSample(data_source=source, prompt=prompt, acc=acc, reward=acc, answer=answer, num_turns=turns,
                      tool_calls=calls, tool_errors=errors, response_length=length)


def test_mean_majority_and_pass_at_k_per_source():
    samples = [
        # prompt 0: one right of three, the wrong answer is the majority
        _s("aime", 0, 1.0, "7"), _s("aime", 0, 0.0, "5"), _s("aime", 0, 0.0, "5"),
        # prompt 1: two right; one sample gave no answer and made no call
        _s("aime", 1, 1.0, "12"), _s("aime", 1, 1.0, "12"), _s("aime", 1, 0.0, None, calls=0),
        # another source, all wrong, with tool errors
        _s("gsm8k", 0, 0.0, "3", calls=2, errors=1), _s("gsm8k", 0, 0.0, "4", calls=2, errors=1), _s("gsm8k", 0, 0.0, None, calls=0),
    ]
    m = summarize(samples, 3)
    assert m["val-core/aime/acc/mean@3"] == pytest.approx(3 / 6)
    assert m["val-core/aime/acc/maj@3"] == pytest.approx(1 / 2)  # prompt 0's majority "5" is wrong, prompt 1's "12" right
    assert m["val-core/aime/acc/pass@3"] == 1.0
    assert m["val-core/gsm8k/acc/pass@3"] == 0.0 and m["val-aux/gsm8k/prompts"] == 1
    assert m["val-aux/gsm8k/tool/error_rate"] == pytest.approx(2 / 4) and m["val-aux/gsm8k/tool/call_rate"] == pytest.approx(2 / 3)
    assert m["val-aux/tool/calls_per_traj"] == pytest.approx(9 / 9)
    assert m["val-aux/num_turns/mean"] == 2 and m["val-aux/response_length/mean"] == 50
    rows = table(m, 3).splitlines()
    assert rows[0].split()[:5] == ["source", "prompts", "mean@3", "maj@3", "pass@3"]
    assert rows[1].split()[:5] == ["aime", "2", "0.500", "0.500", "1.000"] and rows[2].startswith("gsm8k")


def test_majority_ties_go_to_the_earliest_answer_and_no_answer_is_wrong():
    assert majority_correct([_s("x", 0, 1.0, "1"), _s("x", 0, 0.0, "2")]) == 1.0
    assert majority_correct([_s("x", 0, 0.0, "2"), _s("x", 0, 1.0, "1")]) == 0.0
    assert majority_correct([_s("x", 0, 0.0, None)]) == 0.0
    with pytest.raises(ValueError):
        summarize([], 4)


def test_a_data_source_with_slashes_is_one_segment_of_its_metric_names(tmp_path):
    """verl's gsm8k, MATH and geometry3k preprocessing write data_source 'openai/gsm8k'-style names."""
    import json

    from raytool.console import summary

    m = summarize([_s("openai/gsm8k", 0, 1.0, "7"), _s("openai/gsm8k", 0, 0.0, "5"), _s("100%/x", 1, 1.0, "1")], 2)
    assert m["val-core/openai%2Fgsm8k/acc/mean@2"] == 0.5 and m["val-aux/openai%2Fgsm8k/prompts"] == 1
    assert m["val-core/100%25%2Fx/acc/pass@2"] == 1.0
    assert [r.split()[0] for r in table(m, 2).splitlines()[1:]] == ["100%/x", "openai/gsm8k"]
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, **m}) + "\n")
    lines = summary(tmp_path, 1.0)
    assert "held-out accuracy (openai/gsm8k, mean@2): 0.50 at step 0" in lines


def test_accuracy_is_the_rewards_own_acc_else_a_score_of_at_least_one_and_the_summary_says_which(tmp_path):
    """A constant 0.5 reward gave a random model "held-out accuracy 0.75" when accuracy was score > 0."""
    import json

    from raytool.console import summary
    from raytool.types import ACC_THRESHOLD, accuracy

    assert ACC_THRESHOLD == 1.0 and accuracy(0.5, {}) == (0.0, True) and accuracy(1.0, {}) == (1.0, True)
    assert accuracy(-1.0, {"acc": 1.0}) == (1.0, False)  # the reward's own word wins
    samples = [EvalSample(data_source="aime", prompt=0, acc=accuracy(0.5, {})[0], acc_from_score=True, reward=0.5, answer="1", num_turns=1,
                          tool_calls=0, tool_errors=0, response_length=5)]
    m = summarize(samples, 1)
    assert m["val-core/aime/acc/mean@1"] == 0.0 and m["val-aux/acc_from_score"] == 1.0
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, **m}) + "\n")
    assert "(accuracy: score >= 1 where the reward gives no `acc` of its own)" in summary(tmp_path, 1.0)
