"""OpenEnv environments as raytool tasks: the real `openenv-core` package's server (create_app) and
WebSocket client, the guessing game of examples/openenv_guess.py served on loopback (by the loop
itself from its app, and as a separate server at a URL), played by the `openenv` agent loop through
the real gateway and `openai` client on Qwen2.5-Instruct's own chat template with a scripted
engine: observations masked, each session its own, rewards from the environment, failures typed
(see tests/integration/test_openenv_run.py for the example run on Ray)."""

from __future__ import annotations

import asyncio
import random

import pytest

pytest.importorskip("openenv.core")

from helpers.scripted_chat import scripted  # noqa: E402

from raytool.agent import openenv_loop  # noqa: E402
from raytool.agent.registry import check_agents, get_agent_loop  # noqa: E402
from raytool.config import AgentConfig, ConfigError, RolloutConfig  # noqa: E402
from raytool.data.prompts import PromptRow  # noqa: E402
from raytool.types import Message  # noqa: E402

APP = "examples/openenv_guess.py:app"
ASK = [Message("user", "Find my number. Answer with a single number.")]


@pytest.fixture
def served():
    """The loop serves the app in this process; stopped after each test (nothing left running)."""
    yield
    openenv_loop.stop_servers()


def play(renderer, turns_per_sample, seed=3, environment=APP, **env_args):
    agent = AgentConfig(default_agent="openenv", environment=environment, environment_args=env_args or
                        {"action_field": "message", "observation_field": "text"}, max_turns=4, max_response_tokens=256)
    cls = get_agent_loop("openenv")

    async def group():
        out = []
        for i, turns in enumerate(turns_per_sample):
            generate, prompts, generated = scripted(renderer, turns)
            loop = cls(renderer, {}, generate, agent, RolloutConfig(max_tokens_per_turn=32))
            traj = await loop.run(ASK, "", f"g/{i}", "g", extra={"extra_info": {"reset": {"seed": seed}}})
            out.append((traj, generated, prompts))
        return out

    return asyncio.run(group())


def test_a_game_is_played_turn_by_turn_and_only_the_models_tokens_are_trained(qwen, served):
    number = random.Random(3).randint(1, 10)
    wrong = 1 if number != 1 else 2
    ((traj, generated, prompts),) = play(qwen, [[str(wrong), f"Then {number}."]])
    assert [i for i, m in zip(traj.response_ids, traj.response_mask) if m] == [i for g in generated for i in g]
    shown = qwen.tokenizer.decode([i for i, m in zip(traj.response_ids, traj.response_mask) if not m])
    assert ("higher" if wrong < number else "lower") in shown and "3 guesses left" in shown  # the observation, masked
    assert "I picked a number from 1 to 10" in qwen.tokenizer.decode(traj.prompt_ids)  # reset's observation after the row's question
    assert "Find my number" in qwen.tokenizer.decode(traj.prompt_ids)
    assert traj.reward == 1.0 and traj.reward_extra == {"env_steps": 2.0, "env_done": 1.0} and traj.finish_reason == "env_done"
    assert prompts[1][: len(traj.prompt_ids)] == traj.prompt_ids and traj.num_turns == 2


def test_each_trajectory_has_its_own_session_and_an_unfinished_game_scores_its_rewards_so_far(qwen, served):
    number = random.Random(3).randint(1, 10)
    trajs = [t for t, _, _ in play(qwen, [[str(number)], ["no idea"] * 4])]
    assert [t.reward for t in trajs] == [1.0, 0.0]
    assert trajs[1].reward_extra == {"env_steps": 4.0, "env_done": 1.0}  # four wrong guesses end the game: a session of its own
    assert "no number in your answer" in qwen.tokenizer.decode(trajs[1].response_ids)


def test_a_server_at_a_url_is_played_the_same_and_its_failures_are_infrastructure(qwen, served):
    url = openenv_loop.server_url(APP)  # the same app, now as a server others reach by URL
    number = random.Random(3).randint(1, 10)
    ((traj, _, _),) = play(qwen, [[str(number)]], environment=url)
    assert traj.reward == 1.0
    ((gone, _, _),) = play(qwen, [["5"]], environment="http://127.0.0.1:9")
    assert gone.finish_reason == "infra_failed" and gone.infra_failure.startswith("env: ")
    ((bad, _, _),) = play(qwen, [["5"]], action_field="guess", observation_field="text")  # the app's action has no field 'guess'
    assert bad.finish_reason == "infra_failed" and "env: " in bad.infra_failure


def test_a_missing_app_or_server_is_one_line_before_anything_starts(served):
    rows = [PromptRow(prompt=ASK, ground_truth="4", data_source="guess", agent_name="openenv")]
    check_agents(AgentConfig(environment=APP), rows)
    for environment, why in [(None, "need an OpenEnv server"), ("examples/nowhere.py:app", "not found"),
                             ("http://127.0.0.1:9", "does not answer")]:
        with pytest.raises(ConfigError, match=rf"config key 'agent.environment'.*{why}"):
            check_agents(AgentConfig(environment=environment), rows)
    with pytest.raises(ConfigError, match="takes action_field and observation_field, not \\['seed'\\]"):
        get_agent_loop("openenv")(None, {}, None, AgentConfig(environment=APP, environment_args={"seed": 1}), RolloutConfig())
