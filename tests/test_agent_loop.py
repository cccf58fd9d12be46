"""The agent loop over scripted model outputs (a fake engine that replays given text) and the real
local sandbox: masks, every tool error kind, both observation styles, limits, custom loops."""

import asyncio
import copy
import time
from pathlib import Path

import pytest

from raytool.agent.loop import ToolAgentLoop, interpreter_block, reward_view
from raytool.agent.registry import AGENT_LOOPS, get_agent_loop, register_agent_loop
from raytool.agent.render import ChatRenderer
from raytool.agent.turns import turn_text
from raytool.config import AgentConfig, RolloutConfig
from raytool.sandbox.local import LocalBackend
from raytool.tools import CodeInterpreterTool
from raytool.tools.registry import function_tool
from raytool.types import ExecResult, Message, TokenOutput

CALL = "I will compute it.\n<code>\n```python\nprint(1234 * 5678)\n```\n</code>"
ANSWER = "The answer is \\boxed{7006652}."
PROMPT = [Message("system", "Use the tool."), Message("user", "What is 1234 * 5678?")]
CHATML_TOOLS = (Path(__file__).parent / "fixtures" / "chatml_tools_template.jinja").read_text()


def scripted(renderer, turns: list[str], delay_s: float = 0.0):
    """A policy that replays the given turns: each one's tokens, then eos unless the turn ends with
    the in-turn stop string (vLLM keeps a stop string in the output and adds no eos)."""
    calls = []

    async def generate(prompt_ids, sampling, request_id, session):
        text = turns[len(calls)]
        calls.append(list(prompt_ids))
        if delay_s:
            await asyncio.sleep(delay_s)
        stops_in_turn = any(text.endswith(s) for s in sampling.stop)
        ids = renderer.encode(text) if stops_in_turn else renderer.assistant_ids(text)
        ids = ids[: sampling.max_tokens]
        finish = "stop" if stops_in_turn or ids[-1] == renderer.eos_id else "length"
        return TokenOutput(ids, [-0.5] * len(ids), finish, policy_version=7)

    return generate, calls


def make_loop(renderer, turns, tools=None, delay_s=0.0, **agent):
    backend = LocalBackend(warm_sessions=0)
    cell_timeout = agent.pop("cell_timeout_s", 5)

    async def execute_with_timeout(code, session):
        return await backend.run(code, session=session, timeout_s=cell_timeout, memory_mb=512)

    rollout = RolloutConfig(max_tokens_per_turn=agent.pop("max_tokens_per_turn", 96))
    if tools is None:
        tools = {"code_interpreter": CodeInterpreterTool(execute_with_timeout, tokenizer=renderer.tokenizer)}
    generate, calls = scripted(renderer, turns, delay_s)
    loop = ToolAgentLoop(renderer, tools, generate, AgentConfig(**agent), rollout)
    return _Run(loop, backend), calls


class _Run:
    """Runs one trajectory, then shuts the test's sandbox down."""

    def __init__(self, loop, backend):
        self.loop, self.backend = loop, backend

    def __call__(self, uid="t0", prompt=PROMPT):
        async def go():
            try:
                return await self.loop.run(prompt, "7006652", uid, "g0")
            finally:
                await self.backend.aclose()

        return asyncio.run(go())


def observations(traj):
    return [m.content for m in traj.messages if m.role == "tool"]


def test_multi_turn_trajectory_masks_tool_output(renderer, tokenizer):
    run, calls = make_loop(renderer, [CALL, ANSWER])
    traj = run()
    assert traj.finish_reason == "answer" and traj.num_turns == 2 and traj.tool_calls == 1 and traj.tool_errors == 0
    assert len(traj.response_ids) == len(traj.response_mask) == len(traj.rollout_logprobs)
    gen1, gen2 = renderer.assistant_ids(CALL), renderer.assistant_ids(ANSWER)
    obs = renderer.observation_ids([Message("tool", "7006652")], [*PROMPT, Message("assistant", CALL)])
    assert traj.response_ids == gen1 + obs + gen2
    assert traj.response_mask == [1] * len(gen1) + [0] * len(obs) + [1] * len(gen2)
    assert sum(traj.response_mask) == len(gen1) + len(gen2)
    assert traj.rollout_logprobs == [-0.5] * len(gen1) + [0.0] * len(obs) + [-0.5] * len(gen2)
    assert calls[1] == traj.prompt_ids + gen1 + obs  # the second call saw prompt + turn + observation
    text = renderer.conversation_text(traj.messages)  # token-exact against the template's rendering
    assert tokenizer.decode(traj.prompt_ids + traj.response_ids) == text[: text.rfind(tokenizer.eos_token) + len(tokenizer.eos_token)]
    assert reward_view(traj)["response"] == ANSWER and traj.policy_version == 7
    # The trace: each turn's text and timing, each call with its status and output.
    assert [t["text"] for t in traj.turns] == [CALL, ANSWER]
    assert traj.turns[0]["calls"][0]["status"] == "ok" and traj.turns[0]["calls"][0]["output"] == "7006652"
    assert traj.timings["total_s"] >= traj.timings["generate_s"] > 0


def test_state_persists_within_a_trajectory_and_not_across(renderer):
    first = "<code>\nx = 41\n</code>"
    second = "<code>\nx + 1\n</code>"
    run, _ = make_loop(renderer, [first, second, ANSWER])
    loop, backend = run.loop, run.backend

    async def go():
        try:
            a = await loop.run(PROMPT, "42", "traj-a", "g")
            loop.generate, _ = scripted(renderer, [second, ANSWER])
            b = await loop.run(PROMPT, "42", "traj-b", "g")
            return a, b
        finally:
            await backend.aclose()

    a, b = asyncio.run(go())
    assert observations(a) == ["(no output; use print() to see a value)", "42"]
    assert "NameError" in observations(b)[0] and b.tool_error_kinds == {"exit_error": 1}
    assert backend.sessions == {}  # released in finally (the backend was closed, too)


@pytest.mark.parametrize("turn, kind, phrase", [
    ("<code>\n```python\nprint(1)\n", "unterminated_tag", "never closed"),
    ("<code>   </code>", "empty_call", "empty"),
    ("<code>\n1/0\n</code>", "exit_error", "ZeroDivisionError"),
    ("<code>\nimport os; os._exit(3)\n</code>", "exit_error", "exited with code 3"),
    ("<code>\nx = bytearray(1 << 33)\n</code>", "oom", "memory"),
    ("<code>\nwhile True: pass\n</code>", "timeout", "time limit"),
    ("<code>\nimport os, signal; os.kill(os.getpid(), signal.SIGKILL)\n</code>", "killed", "killed"),
])
def test_each_retool_error_kind_is_answered_and_counted(renderer, turn, kind, phrase):
    run, _ = make_loop(renderer, [turn, ANSWER], cell_timeout_s=1)
    traj = run()
    (obs,) = observations(traj)
    assert obs.startswith(f"Error ({kind})") and phrase in obs, obs
    assert traj.tool_error_kinds == {kind: 1} and traj.tool_errors == 1 and traj.tool_calls == 1
    assert traj.finish_reason == "answer" and traj.turns[0]["calls"][0]["kind"] == kind


def _hermes(renderer):
    tok = copy.deepcopy(renderer.tokenizer)
    tok.chat_template = CHATML_TOOLS
    return tok


def _add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def hermes_loop(renderer, turns, **agent):
    """A hermes-format loop on the Qwen-style template, with the code interpreter and an `add` tool."""
    tok = _hermes(renderer)

    async def execute(code, session):
        return ExecResult(status="infra_error", stderr="sandbox down")

    tools = {"code_interpreter": CodeInterpreterTool(execute, tokenizer=tok), "add": function_tool(_add, name="add")}
    r = ChatRenderer(tok, tools=[t.schema for t in tools.values()])
    return make_loop(r, turns, tools=tools, format="hermes", **agent), r


@pytest.mark.parametrize("call, kind, phrase", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}</tool_call>', "invalid_json", "not valid JSON"),
    ('<tool_call>{"name": "mul", "arguments": {"a": 1}}</tool_call>', "unknown_tool", "add, code_interpreter"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "missing_argument", "b"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": "two"}}</tool_call>', "wrong_argument_type", "b"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', "unterminated_tag", "never closed"),
])
def test_each_hermes_error_kind_is_answered_and_counted(renderer, call, kind, phrase):
    (run, _), _ = hermes_loop(renderer, [call, "\\boxed{3}"])
    traj = run()
    (obs,) = observations(traj)
    assert obs.startswith(f"Error ({kind})") and phrase in obs, obs
    assert traj.tool_error_kinds == {kind: 1} and traj.finish_reason == "answer" and traj.infra_failure == ""


def test_a_sandbox_failure_ends_the_trajectory_as_infra_failed_not_as_the_policys_mistake(renderer):
    """The sandbox answered infra_error after the pool's retries: the trajectory stops there (no
    observation of the sandbox's failure is trained on), with the cause, and is counted."""
    call = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(1)"}}</tool_call>'
    (run, calls), _ = hermes_loop(renderer, [call, "\\boxed{3}"])
    traj = run()
    assert traj.finish_reason == "infra_failed" and traj.infra_failure == "sandbox: sandbox down"
    assert observations(traj) == [] and len(calls) == 1  # no second turn was generated
    assert traj.tool_error_kinds == {"sandbox_error": 1} and sum(traj.response_mask) == len(traj.response_ids)


@pytest.mark.parametrize("style", ["tool_message", "in_turn"])
def test_a_generate_call_that_raises_ends_the_trajectory_as_infra_failed_with_the_tokens_so_far(renderer, style):
    """The engine rejected the second turn (a prompt past its context): the first turn and its
    observation are kept, the cause is recorded, nothing is raised."""
    run, calls = make_loop(renderer, [CALL], observation_style=style)
    inner = run.loop.generate

    async def generate(prompt_ids, sampling, request_id, session):
        if calls:
            raise ValueError("This model's maximum context length is 2048 tokens")
        return await inner(prompt_ids, sampling, request_id, session)

    run.loop.generate = generate
    traj = run()
    assert traj.finish_reason == "infra_failed" and traj.num_turns == 1
    assert traj.infra_failure == "generate: ValueError: This model's maximum context length is 2048 tokens"
    assert 0 in traj.response_mask and traj.response_mask[0] == 1  # the call's tokens, then the observation's


def test_a_call_python_cannot_decode_is_answered_not_raised(renderer):
    call = '<tool_call>{"name": "add", "arguments": {"a": ' + "9" * 4400 + ', "b": 2}}</tool_call>'
    (run, _), _ = hermes_loop(renderer, [call, "\\boxed{3}"], max_tokens_per_turn=6000, max_response_tokens=9000)
    traj = run()
    (obs,) = observations(traj)
    assert obs.startswith("Error (invalid_json)") and "4300 digits" in obs and traj.finish_reason == "answer"


def test_hermes_calls_run_concurrently_in_text_order_with_a_per_turn_limit(renderer):
    calls = "".join(f'<tool_call>{{"name": "add", "arguments": {{"a": {i}, "b": 100}}}}</tool_call>' for i in range(4))
    broken = '<tool_call>{"name": "add" "arguments": {}}</tool_call>'
    (run, _), r = hermes_loop(renderer, [calls[:2 * len(calls) // 4] + broken + calls[2 * len(calls) // 4:], "\\boxed{1}"],
                              max_tool_calls_per_turn=3, max_tokens_per_turn=400, max_response_tokens=1200)
    traj = run()
    obs = observations(traj)
    assert obs[:2] == ["100", "101"] and obs[2].startswith("Error (invalid_json)") and obs[3] == "102"
    assert obs[4].startswith("Error (too_many_calls)")  # the 4th well-formed call, beyond the limit of 3
    assert traj.tool_calls == 5 and traj.tool_error_kinds == {"invalid_json": 1, "too_many_calls": 1}
    # The five outputs are one observation (one merged <tool_response> turn), masked 0, token-exact.
    full = r.encode(r.conversation_text(traj.messages))
    ids = traj.prompt_ids + traj.response_ids
    assert ids == full[: len(ids)]


def test_repaired_json_is_counted_not_punished(renderer):
    call = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(len(\'\\frac\'))",}}</tool_call>'
    (run, _), _ = hermes_loop(renderer, [call, "\\boxed{5}"])
    traj = run()
    assert traj.tool_repaired == 1 and "invalid_json" not in traj.tool_error_kinds


def test_in_turn_observations_stay_inside_the_assistant_turn(renderer, tokenizer):
    turn1 = "Let me compute.\n<code>\nprint(1234 * 5678)\n</code>"
    turn2 = " So the answer is \\boxed{7006652}."
    run, calls = make_loop(renderer, [turn1, turn2], observation_style="in_turn")
    traj = run()
    block = interpreter_block("7006652")
    assert traj.finish_reason == "answer" and traj.num_turns == 2 and traj.tool_calls == 1
    assert [m.role for m in traj.messages] == ["system", "user", "assistant"]  # no turn boundary
    assert traj.messages[-1].content == turn1 + block + turn2
    gen1, obs, gen2 = renderer.encode(turn1), renderer.encode(block), renderer.assistant_ids(turn2)
    assert traj.response_ids == gen1 + obs + gen2 and traj.response_mask == [1] * len(gen1) + [0] * len(obs) + [1] * len(gen2)
    assert calls[1] == traj.prompt_ids + gen1 + obs
    text = renderer.conversation_text(traj.messages)
    assert tokenizer.decode(traj.prompt_ids + traj.response_ids) == text[: text.rfind(tokenizer.eos_token) + len(tokenizer.eos_token)]


def test_in_turn_a_close_tag_inside_a_string_cuts_the_code_and_is_counted(renderer):
    # Generation stops at the first </code> (a stop string), even inside the code's own string:
    # the cut code runs, its error goes back to the model, and the cut is counted.
    turn1 = 'Let me check.\n<code>\n```python\nprint("</code>'
    run, _ = make_loop(renderer, [turn1, " \\boxed{1}"], observation_style="in_turn", max_tokens_per_turn=200)
    traj = run()
    assert traj.tool_cut_in_fence == 1 and traj.tool_error_kinds == {"exit_error": 1}
    assert "SyntaxError" in traj.turns[0]["calls"][0]["output"]


def test_turn_limit_token_budget_and_wall_clock(renderer):
    run, _ = make_loop(renderer, [CALL, CALL, CALL], max_turns=2)
    traj = run()
    assert traj.num_turns == 2 and traj.finish_reason == "max_turns" and traj.response_mask[-1] == 1

    run, _ = make_loop(renderer, [CALL, ANSWER], max_response_tokens=10, max_tokens_per_turn=10)
    traj = run()
    assert traj.finish_reason == "length" and len(traj.response_ids) == 10

    # The observation would not fit the budget: the trajectory ends, the output is not cut.
    gen = len(renderer.assistant_ids(CALL))
    run, _ = make_loop(renderer, [CALL, ANSWER], max_response_tokens=gen + 3)
    traj = run()
    assert traj.finish_reason == "length" and traj.response_ids == renderer.assistant_ids(CALL) and traj.turns[0]["observation_dropped"]

    run, _ = make_loop(renderer, [CALL, ANSWER], delay_s=0.4, max_trajectory_s=0.6)
    t = time.monotonic()
    traj = run()
    assert traj.finish_reason == "time_limit" and time.monotonic() - t < 3 and traj.num_turns == 1


def test_a_custom_agent_loop_is_picked_by_name(renderer):
    @register_agent_loop("echo_test_agent")
    class EchoLoop(ToolAgentLoop):
        """Answers at once with the question, to show that a row's agent_name picks the loop."""

        async def _turns(self, state, uid):
            state.finish = "echo"

    assert get_agent_loop("echo_test_agent") is EchoLoop and get_agent_loop("tool_agent") is ToolAgentLoop
    with pytest.raises(ValueError, match="unknown agent loop 'nope'"):
        get_agent_loop("nope")
    AGENT_LOOPS.pop("echo_test_agent")


def test_a_loops_hooks_are_declared_and_a_misspelled_one_is_refused():
    from raytool.agent.registry import loop_hooks

    class Scored(ToolAgentLoop):
        scored_by_environment = True
        row_extra = True

    register_agent_loop("scored_test_agent")(Scored)
    try:
        hooks = loop_hooks(Scored)
        assert hooks.scored_by_loop and hooks.row_extra and hooks.score_group is None and hooks.forget is None
        assert not loop_hooks(ToolAgentLoop).scored_by_loop and not loop_hooks(ToolAgentLoop).row_extra
    finally:
        AGENT_LOOPS.pop("scored_test_agent")

    class Misspelled(ToolAgentLoop):
        scored_by_enviroment = True  # would fall back to reward.fn without a word

    with pytest.raises(ValueError, match=r"'scored_by_enviroment' is no hook \(did you mean 'scored_by_environment'\?\)"):
        register_agent_loop("misspelled_test_agent")(Misspelled)

    class NoRun:
        def run(self, messages, ground_truth, uid, group_id):  # not async
            return None

    with pytest.raises(ValueError, match="has no `async def run"):
        register_agent_loop("no_run_test_agent")(NoRun)
    assert "misspelled_test_agent" not in AGENT_LOOPS and "no_run_test_agent" not in AGENT_LOOPS


def test_readme_custom_agent_example_runs(renderer):
    import re

    readme = (Path(__file__).resolve().parents[1] / "docs" / "agents.md").read_text()
    block = re.search(r"<!-- custom-agent-example -->\s*```python\n(.*?)```", readme, re.DOTALL)
    assert block, "docs/agents.md lost its custom agent example"
    try:
        namespace: dict = {}
        exec(compile(block.group(1), "README.md:custom-agent-example", "exec"), namespace)
        loop_cls = get_agent_loop("careful_agent")
        run, calls = make_loop(renderer, [ANSWER])
        run.loop = loop_cls(run.loop.renderer, run.loop.tools, run.loop.generate, run.loop.agent, run.loop.rollout)
        traj = run()
        assert traj.messages[0].content == "Check every result with the code interpreter."
        assert traj.finish_reason == "answer" and renderer.tokenizer.decode(calls[0]).count("Check every result") == 1
    finally:
        AGENT_LOOPS.pop("careful_agent", None)


def test_a_turns_tool_calls_run_concurrently(renderer):
    async def slow(seconds: float) -> str:
        """Sleep, then say so.

        Args:
            seconds: how long
        """
        await asyncio.sleep(seconds)
        return "done"

    tok = _hermes(renderer)
    tools = {"slow": function_tool(slow)}
    r = ChatRenderer(tok, tools=[t.schema for t in tools.values()])
    three = '<tool_call>{"name": "slow", "arguments": {"seconds": 0.4}}</tool_call>' * 3
    run, _ = make_loop(r, [three, "\\boxed{1}"], tools=tools, format="hermes", max_tokens_per_turn=200)
    t = time.monotonic()
    traj = run()
    assert observations(traj) == ["done"] * 3 and traj.turns[0]["tools_s"] < 0.8 and time.monotonic() - t < 3


def test_in_turn_stop_without_a_code_block_is_answered(renderer):
    run, _ = make_loop(renderer, ["I will write </code>", " \\boxed{1}"], observation_style="in_turn")
    traj = run()
    assert traj.tool_error_kinds == {"unterminated_tag": 1} and "closes no <code>" in traj.messages[-1].content


def test_the_scripted_engine_drives_two_real_cells_and_an_answer(renderer, tiny_model_path):
    """`rollout.engine=scripted` (raytool bench load) behind the real loop and sandbox: two cells,
    the second reading the first's state, then the answer; every scripted id is trained (mask 1)."""
    from raytool.data import make_splits
    from raytool.data.prompts import with_system_prompt
    from raytool.data.tool_arith import prompt_row
    from raytool.engines.scripted import SCRIPT, ScriptedEngine

    engine = ScriptedEngine(tiny_model_path, delay_s=0.01)
    run, _ = make_loop(renderer, [])

    async def generate(prompt_ids, sampling, request_id, session):
        return await engine.generate(prompt_ids, sampling, request_id)

    run.loop.generate = generate
    row = prompt_row(make_splits(4, 1, 0)[0][0], AgentConfig().system_prompt)  # its system prompt shows a <code> block too
    traj = run(prompt=with_system_prompt(row.prompt, AgentConfig().system_prompt))
    assert traj.finish_reason == "answer" and traj.tool_calls == 2 and traj.tool_errors == 0
    assert observations(traj) == ["42", "43"]
    assert [t["text"] for t in traj.turns] == list(SCRIPT)
    assert sum(traj.response_mask) == sum(len(renderer.assistant_ids(text)) for text in SCRIPT)
    assert engine.stats.requests == 3 and engine.engine_stats()["busy_s"] >= 0.03


def test_a_family_whose_markers_are_special_tokens_is_parsed_and_recorded_with_them(renderer):
    """Kimi-K2's call markers are special tokens: the loop parses the turn decoded with them, runs
    the call, and records the turn in the parts Kimi's template writes it from (content, calls with
    their ids as written, arguments as written; the tool result with its call's id), so the template
    renders the turn as it was generated (test_chat_templates.py); a turn that does not read so is
    kept as its text. The trace's text of the turn shows it without the markers."""
    tok = _hermes(renderer)
    markers = ["<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
               "<|tool_calls_section_end|>"]
    tok.add_special_tokens({"additional_special_tokens": markers})
    tools = {"add": function_tool(_add, name="add")}
    r = ChatRenderer(tok, tools=[t.schema for t in tools.values()])
    call = ("Adding.<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
            '{"a": 2, "b": 3}<|tool_call_end|><|tool_calls_section_end|>')
    run, calls = make_loop(r, [call, "It is 5."], tools=tools, format="kimi_k2")
    traj = run()
    assert traj.tool_calls == 1 and traj.tool_errors == 0 and observations(traj) == ["5"]
    assert traj.messages[2] == Message("assistant", "Adding.", tool_calls=[
        {"id": "functions.add:0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}])
    assert traj.messages[3] == Message("tool", "5", tool_call_id="functions.add:0")
    assert turn_text("kimi_k2", traj.messages[2]) == "<think></think>" + call  # its template writes the (empty) reasoning block
    assert traj.turns[0]["text"] == 'Adding.functions.add:0{"a": 2, "b": 3}'
    assert len(calls) == 2

    trailing = call + "Done."  # text after the calls: no such parts, kept as generated
    run, _ = make_loop(r, [trailing, "It is 5."], tools=tools, format="kimi_k2")
    traj = run()
    assert traj.messages[2] == Message("assistant", trailing) and traj.messages[3].tool_call_id is not None


def test_a_format_with_its_own_end_of_call_token_stops_there(renderer):
    """gpt-oss ends a call with <|call|>, not its end of sequence: the engine is told to stop on it."""
    tok = _hermes(renderer)
    tok.add_special_tokens({"additional_special_tokens": ["<|call|>"]})
    run, _ = make_loop(ChatRenderer(tok), ["x"], format="gpt_oss")
    sampling = run.loop._sampling(16, "u", 0)
    assert sampling.stop_token_ids == (run.loop.renderer.eos_id, tok.convert_tokens_to_ids("<|call|>"))
    run, _ = make_loop(ChatRenderer(tok), ["x"], format="hermes")
    assert run.loop._sampling(16, "u", 0).stop_token_ids == (run.loop.renderer.eos_id,)
