"""LLM-judge rewards (raytool.rewards.llm_judge): the real `openai` client against raytool's own
OpenAI-compatible server (raytool.agent.gateway) on loopback, whose scripted engine plays the
judge: it reads the rubric it is sent and answers with a verdict."""

from __future__ import annotations

import time

import pytest
from helpers.judge_server import JudgeServer, grade

from raytool.agent.loop import reward_view
from raytool.config import ConfigError, load_config
from raytool.rewards import RewardError, make_reward_fn
from raytool.rewards.llm_judge import Judge, JudgeError, check_config, parse_score, probe
from raytool.types import Message, Trajectory


def judge_cfg(url: str, *more: str):
    return load_config(None, ["reward.fn=judge", f"reward.judge.base_url={url}", *more]).reward


def view(question: str, answer: str) -> dict:
    traj = Trajectory(uid="u", group_id="g", ground_truth="", prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 1], rollout_logprobs=[0.0, 0.0],
                      messages=[Message("system", "Be brief."), Message("user", question), Message("assistant", answer)])
    return reward_view(traj, 64)


def test_the_judge_scores_by_its_rubric_and_judges_the_same_text_once(tokenizer):
    server = JudgeServer(tokenizer, grade)
    with server as url:
        reward = make_reward_fn(judge_cfg(url))
        right, wrong = view("What is 6 x 7?", "It is 42."), view("What is 6 x 7?", "It is 41.")
        score, metrics = reward(right, "42", {"data_source": "arith"})
        assert score == pytest.approx(0.9) and metrics == {"judge_raw": 9.0, "judge_cached": 0.0}
        assert reward(wrong, "42", {"data_source": "arith"})[0] == pytest.approx(0.2)
        # a group rolled out again: the same text is not judged again
        again = [reward(right, "42", {"data_source": "arith"}) for _ in range(3)]
        assert [s for s, _ in again] == [pytest.approx(0.9)] * 3 and [m["judge_cached"] for _, m in again] == [1.0] * 3
        assert server.calls == 2
        raw = make_reward_fn(judge_cfg(url, "reward.judge.max_score=null", "reward.judge.cache_size=0"))
        assert [raw(right, "42", {})[0] for _ in range(2)] == [9.0, 9.0] and server.calls == 4
    assert reward.concurrency == 8 and make_reward_fn(load_config(None, []).reward).concurrency == 1


def test_the_rubric_sees_the_question_the_reference_and_the_rows_extra_info(tokenizer):
    seen = []

    def record(prompt: str) -> str:
        seen.append(prompt)
        return "score = 7"

    with JudgeServer(tokenizer, record) as url:
        reward = make_reward_fn(judge_cfg(url, "reward.judge.rubric='Q: {prompt} | A: {response} | ref {ground_truth} | style {style}'"))
        assert reward(view("Name a prime.", "<think>2 is even</think>Seven."), "7", {"extra_info": {"style": "terse"}})[0] == 0.7
    assert "Q: Name a prime. | A: Seven. | ref 7 | style terse" in seen[0]


def test_a_judge_that_fails_times_out_or_gives_no_score_raises_and_never_scores_zero(tokenizer):
    with JudgeServer(tokenizer, lambda prompt: "I cannot tell.") as url:
        with pytest.raises(RewardError, match=r"reward fn 'judge' failed.*no score matching reward.judge.score_pattern.*I cannot tell"):
            make_reward_fn(judge_cfg(url))(view("Q?", "A."), "A", {})
    with JudgeServer(tokenizer, grade, delay_s=1.5) as url:
        start = time.monotonic()
        with pytest.raises(RewardError, match="judge_error: the judge at .* failed: .*(timed out|Timeout)"):
            make_reward_fn(judge_cfg(url, "reward.judge.timeout_s=0.5"))(view("What is 6 x 7?", "42"), "42", {})
        assert time.monotonic() - start < 1.5
    with pytest.raises(JudgeError, match="'x' is not a number"):
        parse_score("Score: x", r"Score: (\w)")


def test_bad_judge_settings_are_one_line_before_anything_starts(tokenizer):
    with pytest.raises(ConfigError, match="reward.fn=judge needs reward.judge.base_url"):
        check_config(load_config(None, ["reward.fn=judge"]).reward.judge)
    with pytest.raises(ConfigError, match="score_pattern=.*has no group"):
        check_config(judge_cfg("http://127.0.0.1:9/v1", r"reward.judge.score_pattern=Score \d").judge)
    with pytest.raises(ConfigError, match=r"rubric uses \['style'\], which are neither .* nor in row 1's extra_info"):
        check_config(judge_cfg("http://127.0.0.1:9/v1", "reward.judge.rubric='{response} in {style}'").judge, [{"style"}, {"other"}])
    with pytest.raises(ConfigError, match=r"reward.judge.base_url=http://127.0.0.1:9/v1: the judge does not answer"):
        probe(judge_cfg("http://127.0.0.1:9/v1", "reward.judge.timeout_s=2").judge)
    with JudgeServer(tokenizer, grade) as url:
        probe(judge_cfg(url).judge)  # answers; the model is the one it lists
        with pytest.raises(ConfigError, match=r"reward.judge.model='gpt-4o': the judge at .* serves \['judge-model'\]"):
            probe(judge_cfg(url, "reward.judge.model=gpt-4o").judge)
    assert Judge(judge_cfg("http://127.0.0.1:9/v1").judge).concurrency == 8


def test_a_judge_that_is_the_runs_own_model_asks_where_the_gateway_is_and_again_after_a_failure(tokenizer):
    """reward.judge.base_url self: no URL at start (nothing is probed); the reward worker's
    `own_api` says where the run's gateway serves, on first use and again after a failed call."""
    probe(judge_cfg("self").judge)  # the run's servers start with the run: nothing to ask before
    asked = []
    with JudgeServer(tokenizer, grade) as url, JudgeServer(tokenizer, grade) as moved:
        where = iter([url, "http://127.0.0.1:9/v1", moved])

        def own_api():
            asked.append(next(where))
            return asked[-1]

        reward = make_reward_fn(judge_cfg("self"), own_api=own_api)
        right = view("What is 6 x 7?", "It is 42.")
        assert reward(right, "42", {})[0] == pytest.approx(0.9) and asked == [url]
        reward = make_reward_fn(judge_cfg("self", "reward.judge.cache_size=0"), own_api=own_api)
        with pytest.raises(RewardError, match="judge_error: the judge at http://127.0.0.1:9/v1 failed"):
            reward(right, "42", {})  # the gateway restarted elsewhere: this call fails ...
        assert reward(right, "42", {})[0] == pytest.approx(0.9) and asked[-1] == moved  # ... the next asks again
    with pytest.raises(RewardError, match="reward.judge.base_url is self, but this process belongs to no run"):
        make_reward_fn(judge_cfg("self"))(right, "42", {})
