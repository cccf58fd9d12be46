import os
import signal
import threading
import time

import pytest

from raytool.agent.loop import interpreter_block, reward_view
from raytool.config import ConfigError, RewardConfig, RunConfig, validate
from raytool.rewards import RewardError, make_reward_fn, overlong_penalty, shared_verifier, validate_reward_fn
from raytool.rewards.math import extract_answer, last_boxed, normalize_answer
from raytool.rewards.verify import MathVerifier
from raytool.types import Message, Trajectory


def view(response: str, tool_calls: int = 0, **kw) -> dict:
    return {"response": response, "tool_calls": tool_calls, **kw}


@pytest.fixture(scope="module")
def math_fn():
    return make_reward_fn(RewardConfig(fn="math"))


# --- extraction ----------------------------------------------------------------------------------

def test_last_boxed_handles_nesting_fbox_and_unbalanced():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} and finally \\fbox{\\{a, b\\}}") == "\\{a, b\\}"
    assert last_boxed("no answer") is None
    assert last_boxed("\\boxed{1} then \\boxed{unclosed") is None  # the final answer is broken: no answer


def test_conventions_follow_the_data_source():
    assert extract_answer("so\nAnswer: 34.", "dapo_math_17k") == "34"
    assert extract_answer("**Answer:** $\\frac{1}{2}$", "aime_2025") == "$\\frac{1}{2}$"
    assert extract_answer("Answer: 3\nwait, \\boxed{4}", "aime_2024") == "4"  # boxed first
    assert extract_answer("48 + 24 = 72\n#### 1,234", "gsm8k") == "1,234"
    assert extract_answer("Answer: 5", "tool_arith") is None  # the task asks for \boxed{}
    assert extract_answer("#### 7", "some_new_set") == "7"  # unknown: boxed, Answer:, then ####
    assert extract_answer("thinking...\n<answer>\n\\boxed{12}\n</answer>", "dapo_math_17k") == "12"
    assert extract_answer("<answer> 12 </answer>", "aime_2024") == "12"  # the tag's content when nothing else
    assert extract_answer("<answer>\\boxed{12</answer>", "aime_2024") is None


def test_tool_output_is_never_the_answer(math_fn):
    # in_turn style: the interpreter printed the right number, the model never wrote an answer
    response = "<code>\n```python\nprint(6*7)\n```\n</code>" + interpreter_block("\\boxed{42}\n42") + "I am not sure."
    score, metrics = math_fn(view(response), "42", {"data_source": "tool_arith"})
    assert (score, metrics["has_answer"]) == (0.0, 0.0)
    # the model's own answer after the output counts
    assert math_fn(view(response + " \\boxed{42}"), "42", {"data_source": "tool_arith"})[0] == 1.0


def test_normalization():
    assert normalize_answer(" 1,234 ") == "1234"
    assert normalize_answer("42.0") == "42"
    assert normalize_answer("\\text{Monday}.") == "Monday"
    assert normalize_answer("(1,2)") == "(1,2)"  # a tuple's comma is not a thousands separator


def test_boxed_match_is_exact():
    fn = make_reward_fn(RewardConfig(fn="boxed_match"))
    assert fn(view("so \\boxed{1,234}."), "1234", {})[0] == 1.0
    score, metrics = fn(view("\\boxed{0.5}"), "\\frac{1}{2}", {})
    assert score == 0.0 and metrics["has_answer"] == 1.0


# --- equivalence ---------------------------------------------------------------------------------

@pytest.mark.parametrize("pred, gold", [
    ("1/2", "0.5"), ("0.5", "\\frac{1}{2}"), ("\\dfrac{1}{2}", "1/2"), ("10\\%", "10"), ("5 cm", "5"),
    ("5\\text{ cm}", "5"), ("1,000", "1000"), ("x=3", "3"), ("\\sqrt{4}", "2"), ("007", "7"),
])
def test_math_verify_equivalences(math_fn, pred, gold):
    score, metrics = math_fn(view(f"so \\boxed{{{pred}}}"), gold, {"data_source": "aime_2024"})
    assert score == 1.0 and metrics["acc"] == 1.0


@pytest.mark.parametrize("pred, gold", [("2", "3"), ("\\frac{1}{3}", "0.5"), ("x=4", "3"), ("12", "1234")])
def test_math_verify_rejects_different_answers(math_fn, pred, gold):
    assert math_fn(view(f"\\boxed{{{pred}}}"), gold, {}) == (0.0, {"acc": 0.0, "has_answer": 1.0, "verify_timeout": 0.0})


def test_unparseable_latex_falls_back_to_exact_match(math_fn):
    assert shared_verifier(RewardConfig().timeout_s).verdict("5", "}{") == "unparsed"
    assert math_fn(view("\\boxed{\\text{Monday}}"), "Monday", {})[0] == 1.0
    assert math_fn(view("\\boxed{@@#}"), "@@@", {}) == (0.0, {"acc": 0.0, "has_answer": 1.0, "verify_timeout": 0.0})


PATHOLOGICAL = ["9^{9^{9^{9}}}", "(" * 600, "{" * 400 + "1" + "}" * 400,  # judged, and timed out
                "{" * 10_000 + "1" + "}" * 10_000, "7" * 100_000, "\\frac{" * 3000]  # too long to parse at all


def test_pathological_answers_cannot_stall_the_caller():
    fn = make_reward_fn(RewardConfig(fn="math", timeout_s=0.5))
    fn(view("\\boxed{1/2}"), "0.5", {})  # the child is up
    timeouts = 0.0
    for answer in PATHOLOGICAL:
        start = time.monotonic()
        score, metrics = fn(view(f"\\boxed{{{answer}}}"), "5", {})
        assert time.monotonic() - start < 5.0  # 10x the timeout
        assert score == 0.0
        timeouts += metrics["verify_timeout"]  # counted, not raised
    assert timeouts == 3.0
    assert fn(view("\\boxed{\\frac{1}{2}}"), "0.5", {})[0] == 1.0  # and the next answer is judged as usual


def test_a_stuck_verifier_process_is_replaced():
    verifier = MathVerifier(timeout_s=0.5)
    assert verifier.verdict("0.5", "\\frac{1}{2}") == "equal"
    verifier._spare.wait_ready()
    os.kill(verifier._child.proc.pid, signal.SIGSTOP)  # as if stuck in C code, deaf to its own timer
    start = time.monotonic()
    assert verifier.verdict("0.5", "\\frac{1}{2}") == "timeout"
    assert verifier.verdict("0.5", "\\frac{1}{2}") == "equal"  # the spare took over
    assert time.monotonic() - start < 5.0
    verifier.close()


def test_verification_works_off_the_main_thread(math_fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(math_fn(view("\\boxed{\\frac{1}{2}}"), "0.5", {})[0]))
    thread.start()
    thread.join(timeout=30)
    assert out == [1.0]


# --- shaping -------------------------------------------------------------------------------------

def test_retool_shaping_rewards_tool_use_but_never_above_a_correct_answer():
    fn = make_reward_fn(RewardConfig(fn="retool"))
    assert fn(view("\\boxed{4}", tool_calls=0), "4", {})[0] == 1.0
    assert fn(view("\\boxed{5}", tool_calls=0), "4", {})[0] == -1.0
    assert fn(view("\\boxed{5}", tool_calls=2), "4", {})[0] == pytest.approx(-0.8)
    assert fn(view("\\boxed{5}", tool_calls=100), "4", {})[0] == pytest.approx(-0.6)  # verl's cap
    capped = make_reward_fn(RewardConfig(fn="retool", tool_call_bonus=0.5, wrong_score_cap=0.2))
    assert capped(view("\\boxed{5}", tool_calls=100), "4", {})[0] == pytest.approx(0.2)
    assert capped(view("\\boxed{4}", tool_calls=100), "4", {})[0] == 1.0


def test_overlong_shaping_is_linear_over_the_buffer():
    assert overlong_penalty(700, 1000, 200, 1.0) == 0.0
    assert overlong_penalty(900, 1000, 200, 1.0) == pytest.approx(0.5)
    assert overlong_penalty(1000, 1000, 200, 0.5) == pytest.approx(0.5)
    fn = make_reward_fn(RewardConfig(fn="math", overlong_buffer_tokens=200, overlong_penalty_factor=1.0))
    score, metrics = fn(view("\\boxed{4}", response_tokens=950, max_response_tokens=1000), "4", {})
    assert score == pytest.approx(0.25) and metrics["overlong_penalty"] == pytest.approx(0.75)
    with pytest.raises(RewardError, match="max_response_tokens"):
        fn(view("\\boxed{4}", response_tokens=950, max_response_tokens=None), "4", {})


def test_format_penalty_applies_only_without_a_final_answer():
    fn = make_reward_fn(RewardConfig(fn="math", format_penalty=0.5))
    assert fn(view("I think it is 4"), "4", {})[0] == -0.5
    assert fn(view("\\boxed{5}"), "4", {})[0] == 0.0
    assert fn(view("\\boxed{4}"), "4", {})[0] == 1.0


def test_reward_view_carries_the_response_length():
    traj = Trajectory(uid="u", group_id="g", prompt_ids=[1], response_ids=[5, 6, 7], response_mask=[1, 0, 1],
                      rollout_logprobs=[0.0] * 3, ground_truth="4", tool_calls=1,
                      messages=[Message("user", "q"), Message("assistant", "call"), Message("tool", "\\boxed{4}"), Message("assistant", "\\boxed{5}")])
    v = reward_view(traj, max_response_tokens=384)
    assert (v["response"], v["response_tokens"], v["max_response_tokens"]) == ("\\boxed{5}", 3, 384)
    assert make_reward_fn(RewardConfig(fn="math"))(v, "4", {})[0] == 0.0  # the tool message is never looked at


def test_reward_keys_are_validated():
    for key, value, expected in [("wrong_score_cap", 1.0, "must be < 1"), ("tool_call_bonus", -0.1, ">= 0"),
                                 ("timeout_s", 0.0, "> 0.0, got 0.0"), ("overlong_buffer_tokens", 10_000, "below agent.max_response_tokens")]:
        with pytest.raises(ConfigError, match=f"reward.{key}'.*{expected}"):
            validate(RunConfig(reward=RewardConfig(**{key: value})))


# --- custom fns ----------------------------------------------------------------------------------

def test_custom_reward_fn_from_a_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def score(view, gt, extra):\n    return {'score': len(view['response']) * 0.5, 'x': 1}\n"
                 "def plain(view, gt, extra):\n    return 0.25\n"
                 "def broken(view, gt, extra):\n    return view['missing']\n")
    validate_reward_fn(f"{f}:score")
    assert make_reward_fn(RewardConfig(fn=f"{f}:score"))(view("abcd"), "", {}) == (2.0, {"x": 1.0})
    assert make_reward_fn(RewardConfig(fn=f"{f}:plain"))(view("abcd"), "", {}) == (0.25, {})
    with pytest.raises(RewardError) as err:
        make_reward_fn(RewardConfig(fn=f"{f}:broken"))(view("abcd"), "", {"data_source": "gsm8k"})
    message = str(err.value)
    assert "\n" not in message and f"{f}:broken" in message and "gsm8k" in message and "KeyError" in message and "line 6" in message


@pytest.mark.parametrize("source, spec, expected", [
    ("", "unknown_reward", "not a registered reward"),
    ("", "{d}/missing.py:score", "not found"),
    ("def score(view, gt, extra)\n    return 1\n", "{d}/r.py:score", "line 1: syntax error"),
    ("def score(view, gt, extra):\n    return 1\n", "{d}/r.py:nope", r"has no function 'nope' \(it defines: score\)"),
    ("def score(view, gt):\n    return 1\n", "{d}/r.py:score",
     r"score\(view, gt\) fits neither signature a reward fn may have: raytool's score\(trajectory_view, ground_truth, extra\) "
     r"or verl's score\(data_source, solution_str, ground_truth, extra_info=None\)"),
    ("def score(solution_str, tokenizer):\n    return 1\n", "{d}/r.py:score", r"takes verl's solution_str but cannot be called as verl calls it"),
    ("def score(solution_str, extra_info=None):\n    return 1\n", "{d}/r.py:score", r"takes verl's solution_str but no ground_truth"),
    ("score = 3\n", "{d}/r.py:score", r"'score' is not a function \(it is a int\)"),
    ("import not_a_module_anywhere\n", "{d}/r.py:score", "importing .* failed: ModuleNotFoundError"),
])
def test_custom_reward_fn_errors_are_one_line_naming_the_key(tmp_path, source, spec, expected):
    (tmp_path / "r.py").write_text(source)
    with pytest.raises(ConfigError, match=expected) as err:
        validate_reward_fn(spec.format(d=tmp_path))
    assert str(err.value).startswith("config key 'reward.fn'") and "\n" not in str(err.value)


def _verl_trajectory(tokenizer):
    """A two-turn ReTool trajectory as the agent loop leaves it: the response tokens are the chat
    template's rendering of the assistant turns and the tool's answer after the prompt."""
    from raytool.agent.loop import reward_view
    from raytool.types import Message, Trajectory

    prompt = [Message("system", "Use Python."), Message("user", "What is 6 * 7 + 1?")]
    after = [Message("assistant", "Let me compute.\n<code>\n```python\nprint(6 * 7 + 1)\n```\n</code>"), Message("tool", "43"),
             Message("assistant", "The answer is \\boxed{43}.")]
    as_dicts = lambda ms: [{"role": m.role, "content": m.content} for m in ms]  # noqa: E731
    head = tokenizer.apply_chat_template(as_dicts(prompt), tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(as_dicts(prompt + after), tokenize=False)
    response_ids = tokenizer.encode(whole[len(head):], add_special_tokens=False)
    traj = Trajectory("u0", "g0", tokenizer.encode(head), response_ids, [1] * len(response_ids), [0.0] * len(response_ids),
                      prompt + after, "43", num_turns=2, tool_calls=1)
    return reward_view(traj, 384, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def test_a_verl_reward_fn_is_called_by_keyword_with_the_decoded_response_and_verls_extra_info(tmp_path, tokenizer):
    f = tmp_path / "verl_reward.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float('\\\\boxed{' + ground_truth + '}' in solution_str), 'pred': 'a text extra: left out',\n"
        "            'tool_output_seen': float('43' in solution_str.split('<code>')[1]), 'chat_markup_left': float('<|im_' in solution_str),\n"
        "            'num_turns': extra_info['num_turns'], 'tool_calls': extra_info['tool_calls'], 'index': extra_info['index'],\n"
        "            'source_ok': float(data_source == 'dapo_math_17k')}\n"
        "def keywords_only(*, solution_str, ground_truth, **kwargs):\n"
        "    return float(sorted(kwargs) == ['data_source', 'extra_info'])\n"
        "def gsm8k_style(solution_str, ground_truth, method='strict', format_score=0.0, score=1.0):\n"
        "    return score if ground_truth in solution_str else format_score\n")
    view = _verl_trajectory(tokenizer)
    extra = {"data_source": "dapo_math_17k", "extra_info": {"index": 7, "tools_kwargs": {}}}
    validate_reward_fn(f"{f}:compute_score")
    score, metrics = make_reward_fn(RewardConfig(fn=f"{f}:compute_score"))(view, "43", extra)
    assert score == 1.0
    # verl's num_turns: the prompt, two assistant turns, one round of tool responses
    assert metrics == {"tool_output_seen": 1.0, "chat_markup_left": 0.0, "num_turns": 4, "tool_calls": 1, "index": 7, "source_ok": 1.0}
    assert make_reward_fn(RewardConfig(fn=f"{f}:keywords_only"))(view, "43", extra) == (1.0, {})
    assert make_reward_fn(RewardConfig(fn=f"{f}:gsm8k_style"))(view, "43", extra) == (1.0, {})
    assert make_reward_fn(RewardConfig(fn=f"{f}:gsm8k_style"))(view, "44", extra) == (0.0, {})


def test_a_list_or_dict_ground_truth_reaches_a_verl_reward_fn_as_the_object_it_is(tmp_path, tokenizer):
    """verl passes reward_model.ground_truth as the data set holds it; raytool held a list as JSON text."""
    from raytool.data.prompts import load_prompt_rows, write_prompt_rows

    f = tmp_path / "verl_reward.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return float(isinstance(ground_truth, list) and '43' in ground_truth)\n")
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text('{"data_source": "d", "prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": ["43", "43.0"]}}\n')
    (row,), _ = load_prompt_rows(rows_file)
    assert row.ground_truth == '["43", "43.0"]' and row.ground_truth_json
    (again,), _ = load_prompt_rows(write_prompt_rows(tmp_path / "rows.parquet", [row]))  # raytool's own files keep it
    assert again.ground_truth_json
    reward = make_reward_fn(RewardConfig(fn=f"{f}:compute_score"))
    view = _verl_trajectory(tokenizer)
    assert reward(view, row.ground_truth, {"data_source": "d", "extra_info": {}, "ground_truth_json": row.ground_truth_json})[0] == 1.0
    assert reward(view, "43", {"data_source": "d", "extra_info": {}})[0] == 0.0  # a plain string stays a string


def test_the_shipped_verl_tool_bonus_reward_pays_tool_rounds_on_wrong_answers_up_to_a_cap(tokenizer):
    from pathlib import Path

    spec = f"{Path(__file__).resolve().parents[1] / 'examples' / 'rewards' / 'verl_tool_bonus.py'}:compute_score"
    validate_reward_fn(spec)
    fn = make_reward_fn(RewardConfig(fn=spec))
    right = _verl_trajectory(tokenizer)
    assert fn(right, "43", {"data_source": "dapo_math_17k"}) == (1.0, {"acc": 1.0})
    for rounds, expected in ((0, -1.0), (1, -0.9), (3, -0.7), (6, -0.6)):
        wrong = {**right, "verl_num_turns": 2 + 2 * rounds}
        assert fn(wrong, "44", {"data_source": "dapo_math_17k"}) == (pytest.approx(expected), {"acc": 0.0})


def test_the_reward_sees_the_answer_after_the_reasoning():
    """A thinking model's last turn: what comes after </think> is the response; a \\boxed guess made
    while reasoning is not the answer."""
    traj = Trajectory(uid="u", group_id="g", prompt_ids=[1], response_ids=[5], response_mask=[1], rollout_logprobs=[0.0],
                      ground_truth="4", messages=[Message("user", "q"),
                                                  Message("assistant", "<think>\nMaybe \\boxed{5}? No: 2 + 2.\n</think>\n\n\\boxed{4}")])
    v = reward_view(traj)
    assert (v["response"], v["reasoning"]) == ("\\boxed{4}", "Maybe \\boxed{5}? No: 2 + 2.")
    assert make_reward_fn(RewardConfig(fn="math"))(v, "4", {})[0] == 1.0
    plain = reward_view(Trajectory(uid="u", group_id="g", prompt_ids=[1], response_ids=[5], response_mask=[1], rollout_logprobs=[0.0],
                                   ground_truth="4", messages=[Message("user", "q"), Message("assistant", " \\boxed{4}\n")]))
    assert (plain["response"], plain["reasoning"]) == (" \\boxed{4}\n", "")  # no reasoning: the turn as written
