"""AgentLoopWorker: runs many trajectories concurrently (one asyncio task each) and scores them."""

from __future__ import annotations

import asyncio
import itertools
import zlib

import ray

from raytool.agent.loop import AgentLoop, AgentLoopConfig, reward_view
from raytool.agent.render import ChatRenderer
from raytool.tools import CodeInterpreterTool
from raytool.types import Message, Trajectory


def trajectory_stats(t: Trajectory) -> dict:
    """The small per-trajectory summary the driver logs (the trajectories themselves stay in the store)."""
    return {
        "reward": t.reward,
        "acc": t.reward_extra.get("acc", float(t.reward > 0)),
        "response_length": len(t.response_ids),
        "generated_tokens": sum(t.response_mask),
        "num_turns": t.num_turns,
        "tool_calls": t.tool_calls,
        "tool_errors": t.tool_errors,
        "finish_reason": t.finish_reason,
    }


@ray.remote
class AgentLoopWorker:
    def __init__(self, model_path: str, manager, sandbox_pools: list, reward_workers: list, loop_cfg: AgentLoopConfig, max_tool_output_chars: int):
        from transformers import AutoTokenizer

        self.manager = manager
        self.sandbox_pools = sandbox_pools
        self.reward_workers = itertools.cycle(reward_workers)
        self.renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_path))
        self.loop_cfg = loop_cfg
        self.tools = {"code_interpreter": CodeInterpreterTool(self._execute, max_tool_output_chars)}

    def _pool(self, session: str):
        # A stable hash: every cell of a trajectory reaches the pool that holds its session.
        return self.sandbox_pools[zlib.crc32(session.encode()) % len(self.sandbox_pools)]

    async def _execute(self, code: str, session: str):
        return await self._pool(session).execute.remote(code, session)

    async def _one(self, messages: list[Message], ground_truth: str, uid: str, group_id: str) -> Trajectory:
        async def generate(prompt_ids, sampling, request_id, session):
            return await self.manager.generate.remote(prompt_ids, sampling, request_id, session, group_id)

        try:
            traj = await AgentLoop(self.renderer, self.tools, generate, self.loop_cfg).run(messages, ground_truth, uid, group_id)
        finally:  # whatever happened, the trajectory's interpreter and routing state are released
            self.manager.end_session.remote(uid)
            self._pool(uid).close_session.remote(uid)
        # Score now, while sibling trajectories are still rolling out.
        traj.reward, traj.reward_extra = await next(self.reward_workers).score.remote(reward_view(traj), ground_truth, {})
        return traj

    @ray.method(num_returns=2)
    async def run_group(self, messages: list[Message], ground_truth: str, group_id: str, n: int):
        """n samples of one prompt (a GRPO group) -> (trajectories, their small stats)."""
        trajs = await asyncio.gather(*(self._one(messages, ground_truth, f"{group_id}/{i}", group_id) for i in range(n)))
        return list(trajs), [trajectory_stats(t) for t in trajs]
