import pytest

from raytool.rewards import get_reward_fn, normalize_score
from raytool.rewards.math import boxed_match, last_boxed, normalize_answer


def test_last_boxed_handles_nesting_and_picks_the_last():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("no answer") is None
    assert last_boxed("\\boxed{unclosed") is None


def test_normalization():
    assert normalize_answer(" 1,234 ") == "1234"
    assert normalize_answer("42.0") == "42"


def test_boxed_match_scores():
    assert boxed_match({"response": "so \\boxed{1,234}."}, "1234", {})["score"] == 1.0
    wrong = boxed_match({"response": "\\boxed{12}"}, "1234", {})
    assert wrong["score"] == 0.0 and wrong["has_answer"] == 1.0


def test_reward_from_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def score(view, gt, extra):\n    return {'score': len(view['response']) * 0.5, 'x': 1}\n")
    fn = get_reward_fn(f"{f}:score")
    assert normalize_score(fn({"response": "abcd"}, "", {})) == (2.0, {"x": 1.0})
    with pytest.raises(AttributeError, match="no function 'nope'"):
        get_reward_fn(f"{f}:nope")
    with pytest.raises(ValueError, match="not a registered reward"):
        get_reward_fn("unknown_reward")
