"""verifiers environments as raytool tasks: the real `verifiers` package's environments
(tests/helpers/vf_envs.py: single-turn with a group-level reward function, a ToolEnv with a Python
tool, a stateful multi-turn game, a StatefulToolEnv with a hidden argument, an EnvGroup) rolled out by the `verifiers` agent loop through the real gateway
and `openai` client on Qwen2.5-Instruct's own chat template, with a scripted engine; recorded
token-exactly and scored by the environment's rubric (see tests/integration/test_verifiers_run.py
for a run on Ray)."""

import asyncio
import json

import pytest

pytest.importorskip("verifiers")

from helpers.scripted_chat import scripted  # noqa: E402

from raytool.agent.registry import check_agents, get_agent_loop  # noqa: E402
from raytool.agent.verifiers_loop import environment_rows, load_environment, source_name  # noqa: E402
from raytool.config import AgentConfig, ConfigError, DataConfig, RolloutConfig, load_config, prompt_source  # noqa: E402
from raytool.streaming import rollout_metrics, trajectory_stats  # noqa: E402

ENVS = "helpers.vf_envs"


def tool_call(name, **args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def roll(renderer, loader, turns_per_sample, row=0, **env_args):
    """Roll out one group (a sample per scripted turn list) of the environment's row `row`, then score
    it as the agent worker does -> (trajectories, per-sample generated ids, per-sample prompts)."""
    agent = AgentConfig(format="hermes", environment=f"{ENVS}:{loader}", environment_args=env_args, max_response_tokens=512)
    example = environment_rows(agent.environment, dict(agent.environment_args), "train")[row]
    cls = get_agent_loop("verifiers")

    async def group():
        out = []
        for i, turns in enumerate(turns_per_sample):
            generate, prompts, generated = scripted(renderer, turns)
            loop = cls(renderer, {}, generate, agent, RolloutConfig(max_tokens_per_turn=64))
            traj = await loop.run(example.prompt, example.ground_truth, f"g/{i}", "g", extra={"extra_info": example.extra_info})
            out.append((traj, generated, prompts))
        await cls.score_group([t for t, _, _ in out], 30.0)
        return out

    out = asyncio.run(group())
    return [t for t, _, _ in out], [g for _, g, _ in out], [p for _, _, p in out]


def generated_ids(traj):
    return [i for i, m in zip(traj.response_ids, traj.response_mask) if m]


def test_a_tool_environment_runs_its_tool_and_is_recorded_token_exact(qwen):
    (traj,), (generated,), (prompts,) = roll(qwen, "load_tool_env", [["Adding.\n" + tool_call("add", a=2, b=3), "So it is 5."]])
    assert generated_ids(traj) == [i for g in generated for i in g]  # exactly the engine's ids, in order
    observation = [i for i, m in zip(traj.response_ids, traj.response_mask) if not m]
    assert "5" in qwen.tokenizer.decode(observation) and "tool" in qwen.tokenizer.decode(observation)  # the tool's output, masked out
    assert prompts[1][: len(traj.prompt_ids)] == traj.prompt_ids and traj.num_turns == 2
    assert traj.finish_reason != "infra_failed" and traj.reward == 1.0  # mentions_answer
    assert traj.reward_extra["mentions_answer"] == 1.0 and traj.reward_extra["total_tool_calls"] == 1.0  # the ToolEnv's own call metrics


def test_the_rubric_scores_the_group_together_and_each_function_is_a_metric(qwen):
    answers = [["5"], ["5"], ["The answer is 5"], ["6"]]
    trajs, _, _ = roll(qwen, "load_single_turn", answers)
    share = 3 / 4  # distinct final answers in the group: the group-level function saw all four
    assert [t.reward_extra["exact"] for t in trajs] == [1.0, 1.0, 0.0, 0.0]
    assert [t.reward_extra["mentions_answer"] for t in trajs] == [1.0, 1.0, 1.0, 0.0]
    assert all(t.reward_extra["distinct"] == share for t in trajs)
    assert [t.reward for t in trajs] == pytest.approx([1.0 + 0.5 + 0.25 * share] * 2 + [0.5 + 0.25 * share, 0.25 * share])
    metrics = rollout_metrics([trajectory_stats(t) for t in trajs])
    assert metrics["reward/fn/exact"] == 0.5 and metrics["reward/fn/distinct"] == share and metrics["reward/fn/mentions_answer"] == 0.75


def test_a_stateful_game_answers_each_turn_and_its_messages_stay_out_of_the_loss(qwen):
    (traj,), (generated,), _ = roll(qwen, "load_guess", [["3", "7", "5"]])  # row 0: 2 + 3
    assert generated_ids(traj) == [i for g in generated for i in g] and traj.num_turns == 3
    told = qwen.tokenizer.decode([i for i, m in zip(traj.response_ids, traj.response_mask) if not m])
    assert "No: higher." in told and "No: lower." in told
    assert (traj.reward, traj.reward_extra["guessed"], traj.reward_extra["guesses"]) == (1.0, 1.0, 3.0)


def test_a_failing_rubric_infra_fails_the_group_instead_of_scoring_zero(qwen):
    trajs, _, _ = roll(qwen, "load_failing_rubric", [["5"], ["4"]])
    assert all(t.finish_reason == "infra_failed" for t in trajs)
    assert trajs[0].infra_failure == "env rubric: reward function failing_reward: ValueError: the grader is down"


def test_an_environment_that_raises_mid_rollout_infra_fails_its_trajectory(qwen, monkeypatch):
    env = load_environment(f"{ENVS}:load_single_turn", {})

    async def broken(*args, **kwargs):
        raise ConnectionError("the game server went away")

    monkeypatch.setattr(env, "rollout", broken)
    (traj,), _, _ = roll(qwen, "load_single_turn", [["5"]])
    assert (traj.finish_reason, traj.infra_failure) == ("infra_failed", "env: ConnectionError: the game server went away")


def test_an_environments_datasets_are_the_prompt_rows():
    spec = f"{ENVS}:load_single_turn"
    train, val = environment_rows(spec, {"n": 3}, "train"), environment_rows(spec, {"n": 3}, "eval", limit=2)
    assert [r.ground_truth for r in train] == ["5", "42", "42"] and len(val) == 2
    assert [(m.role, m.content) for m in train[1].prompt] == [("system", "Answer with the number only."), ("user", "What is 17 + 25?")]
    assert train[1].agent_name == "verifiers" and train[1].extra_info == {"example_id": 1, "info": {"index": 1}}
    assert train[1].data_source == "verifiers:helpers.vf_envs:load_single_turn"
    assert source_name("/abs/envs/my_env.py:load_environment") == "verifiers:my_env:load_environment"
    assert source_name("primeintellect/vf-math") == "verifiers:vf-math"
    assert environment_rows(f"{ENVS}:load_failing_rubric", {}, "eval") == []  # no eval dataset: no validation rows
    assert prompt_source(DataConfig(), spec) == "verifiers" and prompt_source(DataConfig(train_files=["a.jsonl"]), spec) == "files"


@pytest.mark.parametrize("spec, args, message", [
    (None, {}, r"config key 'agent.environment': rows with agent_name 'verifiers' need it"),
    ("vf-no-such-env", {}, r"config key 'agent.environment': loading 'vf-no-such-env' failed \(.*"),
    (f"{ENVS}:load_broken", {}, r"loading 'helpers.vf_envs:load_broken' failed \(RuntimeError: the environment's data is missing\)"),
    (f"{ENVS}:load_single_turn", {"no_such_arg": 1}, r"loading 'helpers.vf_envs:load_single_turn' failed \(TypeError: .*no_such_arg"),
    (f"{ENVS}:add", {"a": 1, "b": 2}, r"returned int, not a verifiers Environment"),
])
def test_an_environment_that_cannot_load_stops_the_run_in_one_line(spec, args, message):
    from raytool.data.prompts import PromptRow
    from raytool.types import Message

    with pytest.raises(ConfigError, match=message):
        check_agents(AgentConfig(environment=spec, environment_args=args, default_agent="verifiers"),
                     [PromptRow(prompt=[Message("user", "hi")], ground_truth="1", data_source="x")])


def test_an_environment_no_row_uses_is_an_error_not_ignored(tmp_path):
    with pytest.raises(ConfigError, match=r"'agent.environment': 'helpers.vf_envs:load_single_turn' rolls out no row"):
        check_agents(AgentConfig(environment=f"{ENVS}:load_single_turn"), [])
    with pytest.raises(ConfigError, match=r"'agent.environment': data.task=verifiers takes its prompts from a verifiers environment"):
        load_config(None, ["data.task=verifiers"])


def test_an_environment_loads_off_the_main_thread_where_agent_workers_build_it():
    """verifiers installs signal handlers as an environment is built, which Python refuses off the
    main thread (an agent worker's event loop thread): there the load keeps the process's handlers."""
    import signal
    import threading

    from raytool.agent import verifiers_loop

    before, install, out = signal.getsignal(signal.SIGTERM), signal.signal, {}
    spec = f"{ENVS}:load_guess"
    verifiers_loop._ENVIRONMENTS.pop(verifiers_loop._key(spec, {"n": 2}), None)
    thread = threading.Thread(target=lambda: out.update(env=load_environment(spec, {"n": 2})))
    thread.start()
    thread.join()
    assert type(out["env"]).__name__ == "GuessEnv" and signal.getsignal(signal.SIGTERM) is before
    assert signal.signal is install  # put back


def test_a_stateful_tool_environment_injects_its_hidden_argument_and_keeps_its_state(qwen):
    """StatefulToolEnv: the model calls add_to_total(x) without the hidden `total`; the environment
    injects it from its state and updates the state, which its rubric then reads."""
    (traj,), _, _ = roll(qwen, "load_stateful_tool_env", [[tool_call("add_to_total", x=2), "Done: 42."]])
    told = qwen.tokenizer.decode([i for i, m in zip(traj.response_ids, traj.response_mask) if not m])
    assert "42" in told and traj.reward == 1.0 and traj.finish_reason != "infra_failed"
    assert '"total"' not in qwen.tokenizer.decode(traj.prompt_ids)  # the hidden argument is not in the tools the model sees


def test_an_environment_group_routes_each_row_to_its_environment(qwen):
    rows = environment_rows(f"{ENVS}:load_group", {"n": 2}, "train")
    assert len(rows) == 4 and {r.data_source for r in rows} == {"verifiers:helpers.vf_envs:load_group"}
    (single,), _, _ = roll(qwen, "load_group", [["5"]], row=0, n=2)  # the single-turn environment's row 0: 2 + 3
    assert single.reward == pytest.approx(1.0 + 0.5 + 0.25) and single.num_turns == 1
    (tool,), _, _ = roll(qwen, "load_group", [["Adding.\n" + tool_call("add", a=2, b=3), "So it is 5."]], row=2, n=2)
    assert tool.num_turns == 2 and tool.reward == 1.0 and "5" in qwen.tokenizer.decode(tool.response_ids)
