"""The multi-turn tool agent loop: generate -> parse tool calls -> run tools -> append observation -> ...

Token-in-token-out: the engine's ids are appended verbatim (mask 1, with their log-probs); only
observations are tokenized (mask 0). Two observation styles:
- `tool_message` (hermes, and retool as verl's recipe runs it): a turn ends at the end-of-turn
  token; the tool outputs become `tool` messages, rendered all at once as the chat template's
  delta between the conversation so far and the conversation plus those messages.
- `in_turn` (retool, the ReTool paper): generation stops after `</code>`, the output goes in as
  `<interpreter>...</interpreter>` and generation continues in the same assistant turn.

Every malformed call, unknown tool, bad argument and failed execution is answered with a short,
model-readable error observation and counted by kind (`tool_error_kinds`, logged as
`tool/errors/<kind>`); nothing is dropped. The loop ends on an answer (a turn without a tool
call), the turn limit, the response token budget (an observation that does not fit ends the
trajectory rather than being cut), or the wall-clock limit; an observation the chat template cannot
render exactly ends it with finish reason `render_error` (see `raytool.agent.render`). Tools are
released in `finally`.

A failure that is not the policy's ends the trajectory at once with finish reason `infra_failed`
and the cause in `Trajectory.infra_failure`: a generate call that raised (the engine rejected the
request, no server left, the manager died) or a sandbox that failed a cell after its pool's
retries (`sandbox_error`). Such a trajectory is never scored as the policy's mistake: the driver
rolls its group out again or leaves it out of the loss (`raytool.streaming`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from raytool.agent.families import SPECIAL_MARKERS, get_parser, split_reasoning, stop_token_ids
from raytool.agent.ledger import TokenLedger
from raytool.agent.parsers import ParseResult, ToolError, check_arguments
from raytool.agent.registry import register_agent_loop
from raytool.agent.render import ChatRenderer, RenderError
from raytool.agent.turns import STRUCTURED, call_id, structured_turn
from raytool.config import AgentConfig, RolloutConfig
from raytool.errors import one_line
from raytool.tools.base import Tool, ToolContext, ToolResult
from raytool.types import TIME_LIMIT, Message, SamplingParams, TokenOutput, ToolCall, Trajectory

log = logging.getLogger(__name__)

# (prompt_ids, sampling, request_id, session_id) -> TokenOutput; in the actor graph, LLMManager.generate.
Generate = Callable[[list[int], SamplingParams, str, str], Awaitable[TokenOutput]]

CODE_END = "</code>"


def request_seed(seed: int | None, uid: str, turn: int) -> int | None:
    """The sampling seed of one turn of one trajectory (None: the engine's own randomness)."""
    return None if seed is None else zlib.crc32(f"{seed}:{uid}:{turn}".encode()) & 0x7FFFFFFF


def interpreter_block(output: str) -> str:
    """How an in-turn observation is written into the assistant's text (the ReTool paper's tags;
    `raytool.agent.render` masks exactly this shape in SFT traces)."""
    return f"\n<interpreter>\n{output}\n</interpreter>\n"


@dataclass
class _State:
    """Everything recorded so far; what a trajectory is built from, however the loop ended."""

    messages: list[Message]
    ledger: TokenLedger  # the tokens, as the engine saw them
    max_response_tokens: int
    turns: list[dict] = field(default_factory=list)  # the trace: one entry per generate call
    calls: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    repaired: int = 0
    cut_in_fence: int = 0
    finish: str = "max_turns"
    infra: str = ""  # the cause of an infrastructure failure that ended it ("": none)

    def infra_failed(self, cause: str) -> None:
        self.infra, self.finish = cause, "infra_failed"

    def room(self) -> int:
        """Response tokens left in the budget (agent.max_response_tokens)."""
        return self.max_response_tokens - len(self.ledger.response_ids)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


@register_agent_loop("tool_agent")
class ToolAgentLoop:
    """The default agent: multi-turn tool calling in the configured format and observation style."""

    def __init__(self, renderer: ChatRenderer, tools: dict[str, Tool], generate: Generate, agent: AgentConfig, rollout: RolloutConfig):
        self.renderer = renderer
        self.tools = tools
        self.generate = generate
        self.agent = agent
        self.rollout = rollout
        self.parse = get_parser(agent.format, {name: tool.schema for name, tool in tools.items()})
        self.with_special_tokens = agent.format in SPECIAL_MARKERS  # its markers are special tokens: parse them
        self.structured = agent.format in STRUCTURED  # its template takes a turn in parts (raytool.agent.turns)
        self.stop_ids = (renderer.eos_id, *stop_token_ids(agent.format, renderer.tokenizer))
        self.in_turn = agent.observation_style == "in_turn"

    def _sampling(self, budget: int, uid: str, turn: int) -> SamplingParams:
        r = self.rollout
        return r.sampling(max_tokens=min(r.max_tokens_per_turn, budget), stop_token_ids=self.stop_ids, stop=(CODE_END,) if self.in_turn else (),
                          seed=request_seed(r.seed, uid, turn))

    async def run(self, messages: list[Message], ground_truth: str, uid: str, group_id: str) -> Trajectory:
        state = _State(messages=list(messages), ledger=TokenLedger(self.renderer.prompt_ids(messages)), max_response_tokens=self.agent.max_response_tokens)
        start = time.monotonic()
        try:
            await asyncio.wait_for(self._turns(state, uid), self.agent.max_trajectory_s)
        except asyncio.TimeoutError:
            state.finish = TIME_LIMIT
        finally:
            await self._release(uid)
        return state.ledger.trajectory(
            uid, group_id, state.messages, ground_truth, num_turns=len(state.turns), tool_calls=state.calls,
            tool_errors=sum(state.errors.values()), tool_error_kinds=dict(state.errors), tool_repaired=state.repaired,
            tool_cut_in_fence=state.cut_in_fence, finish_reason=state.finish, turns=state.turns, infra_failure=state.infra,
            timings={"total_s": time.monotonic() - start, "generate_s": sum(t["generate_s"] for t in state.turns),
                     "tools_s": sum(t.get("tools_s", 0.0) for t in state.turns)},
        )

    async def _release(self, uid: str) -> None:
        ctx = ToolContext(trajectory_id=uid)
        for tool in self.tools.values():
            release = getattr(tool, "release", None)
            if release is not None:
                try:
                    await release(ctx)
                except Exception as exc:  # a failed release must not lose the trajectory; the pool expires idle sessions
                    log.warning("agent loop: releasing tool %s for %s failed: %s", tool.name, uid, exc)

    async def _generate(self, state: _State, uid: str, turn: int) -> tuple[TokenOutput, dict] | None:
        budget = state.room()
        if budget <= 0:
            state.finish = "length"
            return None
        t = time.monotonic()
        try:
            out = await self.generate(state.ledger.context(), self._sampling(budget, uid, turn), f"{uid}-{turn}", uid)
        except Exception as exc:  # the engine's side failed, not the policy: end here, the driver retries the group
            state.infra_failed(f"generate: {one_line(exc)}")
            log.warning("agent loop: trajectory %s ends: %s", uid, state.infra)
            return None
        state.ledger.generated(out)
        info = {"text": self.renderer.tokenizer.decode(out.token_ids, skip_special_tokens=True), "tokens": len(out.token_ids),
                "finish": out.finish_reason, "generate_s": time.monotonic() - t}
        state.turns.append(info)
        return out, info

    async def _turns(self, state: _State, uid: str) -> None:
        """The one turn loop: generate, read the turn's calls, run them, append their output; the
        observation style (`_ToolMessages`, `_InTurn`) says how a turn is written down and how its
        output goes back to the model."""
        style = _InTurn(self) if self.in_turn else _ToolMessages(self)
        try:
            for turn in range(self.agent.max_turns):
                got = await self._generate(state, uid, turn)
                if got is None:
                    return
                out, info = got
                style.replied(state, out, info, f"{uid}-{turn}")
                if out.finish_reason != "stop":
                    state.finish = "length" if out.finish_reason == "length" else out.finish_reason
                    return
                parsed = style.calls(out, info)
                if parsed is None:
                    state.finish = "answer"
                    return
                if turn == self.agent.max_turns - 1:
                    state.finish = "max_turns"  # no turn left to read the output in
                    return
                outputs = await self._observe(parsed, uid, state, info)
                if state.infra:
                    return
                try:
                    obs_ids = style.observation(state, outputs, f"{uid}-{turn}")
                except RenderError as exc:  # never a guessed observation: end here and say why
                    state.finish = "render_error"
                    info["render_error"] = str(exc)
                    log.warning("agent loop: trajectory %s ends: %s", uid, exc)
                    return
                if len(obs_ids) >= state.room():
                    state.finish = "length"  # the observation does not fit: end here rather than cut it
                    info["observation_dropped"] = True
                    return
                style.observed(state)
                state.ledger.observed(obs_ids)
        finally:
            style.close(state)

    async def _observe(self, parsed: ParseResult, uid: str, state: _State, info: dict) -> list[str]:
        """Answer every item of a turn (calls run concurrently, up to the per-turn limit) in text order."""
        state.repaired += parsed.repaired
        state.cut_in_fence += parsed.cut_in_fence
        items = parsed.items()
        limit = self.agent.max_tool_calls_per_turn
        t = time.monotonic()

        # The limit counts well-formed calls, in text order; a malformed one costs nothing to answer.
        call_index = {id(item): i for i, item in enumerate(x for x in items if not isinstance(x, ToolError))}

        async def answer(item: ToolCall | ToolError) -> tuple[str, dict]:
            if isinstance(item, ToolError):
                return item.message, {"kind": item.kind, "ok": False}
            if call_index[id(item)] >= limit:
                return (f"Error (too_many_calls): at most {limit} tool calls per turn; this one was not run. "
                        "Make fewer calls and wait for their results."), {"name": item.name, "kind": "too_many_calls", "ok": False}
            result = await self._call(item, uid)
            return result.text, {"name": item.name, "arguments": item.arguments, "ok": result.ok, "kind": result.kind, **result.metrics}

        answers = await asyncio.gather(*[answer(item) for item in items])
        info["tools_s"] = time.monotonic() - t
        info["calls"] = []
        for text, record in answers:
            state.calls += 1
            if not record["ok"]:
                state.error(record["kind"] or "tool_exception")
            info["calls"].append({**record, "output": text})
        failed = [r for _, r in answers if r.get("kind") == "sandbox_error"]
        if failed:  # the sandbox failed after its pool's retries: the observation would be the infrastructure's, not the policy's
            state.infra_failed(f"sandbox: {failed[0].get('detail') or 'sandbox_error'}")
            log.warning("agent loop: trajectory %s ends: %s", uid, state.infra)
        return [text for text, _ in answers]

    async def _call(self, call: ToolCall, uid: str) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"Error (unknown_tool): there is no tool named '{call.name}'; the tools are: {', '.join(sorted(self.tools))}.",
                              ok=False, kind="unknown_tool")
        bad = check_arguments(call, tool.schema)
        if bad is not None:
            return ToolResult(bad.message, ok=False, kind=bad.kind)
        try:
            return await tool.execute(call, ToolContext(trajectory_id=uid))
        except Exception as exc:  # the tool's own bug: the model still gets an answer
            return ToolResult(f"Error (tool_exception): the tool '{call.name}' failed: {type(exc).__name__}: {str(exc)[:200]}",
                              ok=False, kind="tool_exception")


class _ToolMessages:
    """hermes and the families' formats (and retool as verl's recipe runs it): a turn ends at the
    end-of-turn token and is one assistant message; its calls' outputs become `tool` messages,
    rendered all at once as the chat template's delta between the conversation so far and the
    conversation plus those messages."""

    def __init__(self, loop: ToolAgentLoop):
        self.loop = loop
        self.message: Message | None = None  # the last turn, read in parts (a template that takes it so)
        self.pending: list[Message] = []  # the last turn's observations, until they are committed

    def replied(self, state: _State, out: TokenOutput, info: dict, turn_id: str) -> None:
        # A format whose call markers are special tokens keeps them in the message (the template
        # then renders the turn as it was generated); the trace's text shows the turn without them.
        # A template that takes a turn in parts gets it so (reasoning, content, calls with their ids).
        loop = self.loop
        reply = loop.renderer.reply_text(out.token_ids) if loop.with_special_tokens else info["text"]
        self.message = structured_turn(loop.agent.format, reply, turn_id) if loop.structured else None
        state.messages.append(self.message or Message("assistant", reply))

    def calls(self, out: TokenOutput, info: dict) -> ParseResult | None:
        """The turn's calls, or None for an answer (a turn without one)."""
        loop = self.loop
        text = loop.renderer.tokenizer.decode(out.token_ids, skip_special_tokens=False) if loop.with_special_tokens else info["text"]
        parsed = loop.parse(text)
        return parsed if parsed.any else None

    def observation(self, state: _State, outputs: list[str], turn_id: str) -> list[int]:
        ids = self._call_ids(len(outputs), turn_id)
        self.pending = [Message("tool", text, tool_call_id=ident) for text, ident in zip(outputs, ids)]
        return self.loop.renderer.observation_ids(self.pending, state.messages)

    def observed(self, state: _State) -> None:
        state.messages.extend(self.pending)

    def close(self, state: _State) -> None:
        """Every turn is in the conversation already."""

    def _call_ids(self, n: int, seed: str) -> list[str | None]:
        """The tool_call_id of each of a turn's `n` answers: the ids of its calls where the turn was read
        in parts and they match the answers one to one, made-up ones where the template needs ids
        anyway, None where it takes none."""
        if not self.loop.structured:
            return [None] * n
        if self.message is not None and self.message.tool_calls and len(self.message.tool_calls) == n:
            return [c.get("id") or call_id(seed, i) for i, c in enumerate(self.message.tool_calls)]
        return [call_id(seed, i) for i in range(n)]


class _InTurn:
    """retool as the ReTool paper runs it: one assistant turn; generation stops after `</code>`, the
    output goes in as an `<interpreter>` block and generation continues in the same turn."""

    def __init__(self, loop: ToolAgentLoop):
        self.loop = loop
        self.content = ""  # the assistant turn so far
        self.block = ""  # the last call's output block, until it is committed

    def replied(self, state: _State, out: TokenOutput, info: dict, turn_id: str) -> None:
        self.content += info["text"]

    def calls(self, out: TokenOutput, info: dict) -> ParseResult | None:
        """The code before the stop at `</code>`, or None for an answer (ended on the end-of-turn token)."""
        if not info["text"].rstrip().endswith(CODE_END):
            return None
        parsed = self.loop.parse(info["text"])
        if not parsed.any:  # stopped at a </code> that closes no <code>: say so rather than go on silently
            parsed.add(ToolError("unterminated_tag", f"Error (unterminated_tag): {CODE_END} closes no <code> block; "
                                                     "write <code>\n```python\n...\n```\n</code>."))
        return parsed

    def observation(self, state: _State, outputs: list[str], turn_id: str) -> list[int]:
        self.block = "".join(interpreter_block(text) for text in outputs)
        return self.loop.renderer.encode(self.block)

    def observed(self, state: _State) -> None:
        self.content += self.block

    def close(self, state: _State) -> None:
        """The one assistant turn, however the loop ended."""
        state.messages.append(Message("assistant", self.content))


def reward_view(traj: Trajectory, max_response_tokens: int | None = None, decode: Callable[[list[int]], str] | None = None) -> dict:
    """What a reward fn sees: the question (`prompt`: the last user message before the first
    assistant turn), the final assistant text (after its reasoning: a `</think>` block's
    text is `reasoning`), all assistant turns, tool counts, and the response length against its budget (agent.max_response_tokens; DAPO's overlong shaping needs both).
    Tool messages are left out of `response` and `turns`; with the in_turn style, tool output is
    inside `response` as <interpreter> blocks (`raytool.rewards.math.strip_interpreter` removes them).
    For verl-style fns (raytool.rewards): `solution_str`, every response token decoded without
    special tokens (tool output included, as verl decodes it; needs `decode`), and `verl_num_turns`,
    verl's count of a conversation's turns (the prompt, each assistant turn, each round of tool
    responses)."""
    replies = [m for m in traj.messages if m.role == "assistant"]
    turns = [m.content for m in replies]
    first = next((i for i, m in enumerate(traj.messages) if m.role == "assistant"), len(traj.messages))
    asked = [m.content for m in traj.messages[:first] if m.role == "user"]
    tool_rounds = sum(1 for before, m in zip(traj.messages, traj.messages[1:]) if m.role == "tool" and before.role == "assistant")
    last = turns[-1] if turns else ""
    if replies and replies[-1].reasoning_content is not None:  # recorded in parts
        reasoning, answer = replies[-1].reasoning_content.strip(), last.strip()
    else:
        reasoning, answer = split_reasoning(last) if "</think>" in last else ("", last)
    return {
        "prompt": asked[-1] if asked else "",
        "response": answer,
        "reasoning": reasoning,
        "turns": turns,
        "num_turns": traj.num_turns,
        "tool_calls": traj.tool_calls,
        "tool_errors": traj.tool_errors,
        "finish_reason": traj.finish_reason,
        "response_tokens": len(traj.response_ids),
        "max_response_tokens": max_response_tokens,
        "solution_str": decode(traj.response_ids) if decode is not None else None,
        "verl_num_turns": 1 + len(turns) + tool_rounds,
    }
