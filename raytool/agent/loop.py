"""The multi-turn agent loop: generate -> parse tool calls -> run tools -> append observation -> ...

Token-in-token-out: the engine's ids are appended verbatim (mask 1, with their log-probs); only
tool observations are tokenized, as a chat-template delta (mask 0). The loop ends on a turn with no
tool call (the answer), on the turn limit, or on the response token budget.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Awaitable, Callable

from raytool.agent.parsers import get_parser
from raytool.agent.render import ChatRenderer
from raytool.tools.base import Tool, ToolContext
from raytool.types import Message, SamplingParams, TokenOutput, Trajectory

# (prompt_ids, sampling, request_id, session_id) -> TokenOutput; in the actor graph, LLMManager.generate.
Generate = Callable[[list[int], SamplingParams, str, str], Awaitable[TokenOutput]]


@dataclass
class AgentLoopConfig:
    max_turns: int = 3
    max_response_tokens: int = 384
    max_tokens_per_turn: int = 96
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    tool_parser: str = "retool"
    seed: int | None = None  # per-request sampling seeds from (seed, trajectory id, turn): reproducible rollouts


def request_seed(seed: int | None, uid: str, turn: int) -> int | None:
    """The sampling seed of one turn of one trajectory (None: the engine's own randomness)."""
    return None if seed is None else zlib.crc32(f"{seed}:{uid}:{turn}".encode()) & 0x7FFFFFFF


class AgentLoop:
    def __init__(self, renderer: ChatRenderer, tools: dict[str, Tool], generate: Generate, cfg: AgentLoopConfig):
        self.renderer = renderer
        self.tools = tools
        self.generate = generate
        self.cfg = cfg
        self.parse = get_parser(cfg.tool_parser)

    async def _call_tools(self, text: str, uid: str, counts: dict) -> list[Message] | None:
        """Run the turn's tool calls; None if the turn made none (it is the answer)."""
        parsed = self.parse(text)
        if not parsed.any:
            return None
        observations = []
        for call in parsed.calls:
            counts["calls"] += 1
            tool = self.tools.get(call.name)
            if tool is None:
                counts["errors"] += 1
                observations.append(Message("tool", f"Error: unknown tool '{call.name}'; available: {sorted(self.tools)}"))
                continue
            result = await tool.execute(call, ToolContext(trajectory_id=uid))
            counts["errors"] += 0 if result.ok else 1
            observations.append(Message("tool", result.text))
        for error in parsed.errors:  # malformed calls are answered, not dropped
            counts["calls"] += 1
            counts["errors"] += 1
            observations.append(Message("tool", f"Error: {error}"))
        return observations

    async def run(self, messages: list[Message], ground_truth: str, uid: str, group_id: str) -> Trajectory:
        cfg = self.cfg
        messages = list(messages)
        prompt_ids = self.renderer.prompt_ids(messages)
        response_ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        counts = {"calls": 0, "errors": 0}
        finish = "max_turns"
        turns = 0
        version = 0
        for turn in range(cfg.max_turns):
            budget = cfg.max_response_tokens - len(response_ids)
            if budget <= 0:
                finish = "length"
                break
            sampling = SamplingParams(
                max_tokens=min(cfg.max_tokens_per_turn, budget),
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                stop_token_ids=(self.renderer.eos_id,),
                seed=request_seed(cfg.seed, uid, turn),
            )
            out = await self.generate(prompt_ids + response_ids, sampling, f"{uid}-{turn}", uid)
            version = out.policy_version
            turns += 1
            response_ids += out.token_ids
            mask += [1] * len(out.token_ids)
            logprobs += out.logprobs
            text = self.renderer.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            messages.append(Message("assistant", text))
            if out.finish_reason != "stop":
                finish = "length" if out.finish_reason == "length" else out.finish_reason
                break
            observations = await self._call_tools(text, uid, counts)
            if observations is None:
                finish = "answer"
                break
            if turn == cfg.max_turns - 1:
                break  # no turn left to read the output in
            obs_ids = self.renderer.observation_ids(observations)
            if len(response_ids) + len(obs_ids) >= cfg.max_response_tokens:
                finish = "length"
                break
            messages.extend(observations)
            response_ids += obs_ids
            mask += [0] * len(obs_ids)
            logprobs += [0.0] * len(obs_ids)
        return Trajectory(
            uid=uid,
            group_id=group_id,
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=mask,
            rollout_logprobs=logprobs,
            messages=messages,
            ground_truth=ground_truth,
            num_turns=turns,
            tool_calls=counts["calls"],
            tool_errors=counts["errors"],
            finish_reason=finish,
            policy_version=version,
        )


def reward_view(traj: Trajectory) -> dict:
    """What a reward fn sees: the final assistant text, all assistant turns, and tool counts."""
    turns = [m.content for m in traj.messages if m.role == "assistant"]
    return {
        "response": turns[-1] if turns else "",
        "turns": turns,
        "num_turns": traj.num_turns,
        "tool_calls": traj.tool_calls,
        "tool_errors": traj.tool_errors,
        "finish_reason": traj.finish_reason,
    }
