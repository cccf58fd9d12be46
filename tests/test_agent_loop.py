"""The agent loop on real multi-turn trajectories: a scripted policy, the real local sandbox."""

import asyncio

import pytest

from raytool.agent.loop import AgentLoop, AgentLoopConfig, reward_view
from raytool.sandbox.local import LocalBackend
from raytool.tools import CodeInterpreterTool
from raytool.types import Message, TokenOutput

CALL = "I will compute it.\n<code>\n```python\nprint(1234 * 5678)\n```\n</code>"
ANSWER = "The answer is \\boxed{7006652}."


def scripted(renderer, turns: list[str]):
    """A policy that emits the canonical tokens of the given turns, then eos, one per call."""
    calls = []

    async def generate(prompt_ids, sampling, request_id, session):
        text = turns[len(calls)]
        calls.append(list(prompt_ids))
        ids = renderer.assistant_ids(text)[: sampling.max_tokens]
        finish = "stop" if ids[-1] == renderer.eos_id else "length"
        return TokenOutput(ids, [-0.5] * len(ids), finish, policy_version=7)

    return generate, calls


class _LoopWithSandbox:
    """An AgentLoop over a fresh local sandbox that is shut down when the trajectory ends."""

    def __init__(self, loop: AgentLoop, backend: LocalBackend):
        self.loop, self.backend = loop, backend

    async def run(self, *args):
        try:
            return await self.loop.run(*args)
        finally:
            await self.backend.aclose()


def make_loop(renderer, turns, **cfg):
    backend = LocalBackend(warm_sessions=0)

    async def execute(code, session):
        return await backend.run(code, session=session, timeout_s=5, memory_mb=512)

    generate, calls = scripted(renderer, turns)
    loop = AgentLoop(renderer, {"code_interpreter": CodeInterpreterTool(execute)}, generate, AgentLoopConfig(**cfg))
    return _LoopWithSandbox(loop, backend), calls


PROMPT = [Message("system", "Use the tool."), Message("user", "What is 1234 * 5678?")]


def test_multi_turn_trajectory_masks_tool_output(renderer, tokenizer):
    loop, calls = make_loop(renderer, [CALL, ANSWER])
    traj = asyncio.run(loop.run(PROMPT, "7006652", "t0", "g0"))
    assert traj.finish_reason == "answer" and traj.num_turns == 2 and traj.tool_calls == 1 and traj.tool_errors == 0
    assert len(traj.response_ids) == len(traj.response_mask) == len(traj.rollout_logprobs)
    # Generated tokens are 1, the observation tokens between the two turns are 0.
    gen1, gen2 = renderer.assistant_ids(CALL), renderer.assistant_ids(ANSWER)
    obs = renderer.observation_ids([Message("tool", "7006652")])
    assert traj.response_ids == gen1 + obs + gen2
    assert traj.response_mask == [1] * len(gen1) + [0] * len(obs) + [1] * len(gen2)
    assert traj.rollout_logprobs == [-0.5] * len(gen1) + [0.0] * len(obs) + [-0.5] * len(gen2)
    assert tokenizer.decode([t for t, m in zip(traj.response_ids, traj.response_mask) if not m]).count("7006652") == 1
    # The second generate call saw exactly prompt + first turn + observation.
    assert calls[1] == traj.prompt_ids + gen1 + obs
    # Token-exact against the template's rendering of the recorded messages.
    text = renderer.conversation_text(traj.messages)
    assert tokenizer.decode(traj.prompt_ids + traj.response_ids) == text[: text.rfind(tokenizer.eos_token) + len(tokenizer.eos_token)]
    assert reward_view(traj)["response"] == ANSWER and traj.policy_version == 7


def test_malformed_call_is_answered_with_an_error(renderer):
    loop, _ = make_loop(renderer, ["<code>\n```python\nprint(1)\n", ANSWER])
    traj = asyncio.run(loop.run(PROMPT, "1", "t1", "g1"))
    tool_msgs = [m.content for m in traj.messages if m.role == "tool"]
    assert tool_msgs == ["Error: malformed tool call: <code> opened but never closed with </code>"]
    assert traj.tool_calls == 1 and traj.tool_errors == 1 and traj.finish_reason == "answer"


def test_failing_code_reports_stderr(renderer):
    loop, _ = make_loop(renderer, ["<code>\n```python\n1/0\n```\n</code>", ANSWER])
    traj = asyncio.run(loop.run(PROMPT, "1", "t2", "g2"))
    tool_msg = next(m.content for m in traj.messages if m.role == "tool")
    assert tool_msg.startswith("Error:") and "ZeroDivisionError" in tool_msg and traj.tool_errors == 1


def test_turn_limit_and_token_budget(renderer):
    loop, _ = make_loop(renderer, [CALL, CALL, CALL], max_turns=2)
    traj = asyncio.run(loop.run(PROMPT, "1", "t3", "g3"))
    assert traj.num_turns == 2 and traj.finish_reason == "max_turns"
    assert traj.response_mask[-1] == 1  # ends on generated tokens; no dangling observation

    loop, _ = make_loop(renderer, [CALL, ANSWER], max_response_tokens=10, max_tokens_per_turn=10)
    traj = asyncio.run(loop.run(PROMPT, "1", "t4", "g4"))
    assert traj.finish_reason == "length" and len(traj.response_ids) == 10


@pytest.mark.parametrize("parser", ["hermes"])
def test_hermes_parser_drives_the_same_loop(renderer, parser):
    call = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(40 + 2)"}}</tool_call>'
    loop, _ = make_loop(renderer, [call, "\\boxed{42}"], tool_parser=parser)
    traj = asyncio.run(loop.run(PROMPT, "42", "t5", "g5"))
    assert [m.content for m in traj.messages if m.role == "tool"] == ["42"]
