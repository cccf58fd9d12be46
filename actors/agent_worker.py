"""AgentLoopWorker: runs many trajectories concurrently (one asyncio task each) and scores them."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import zlib

import msgspec
import ray

from raytool.agent.loop import reward_view
from raytool.agent.registry import get_agent_loop
from raytool.agent.render import ChatRenderer
from raytool.config import AgentConfig, RolloutConfig, RunConfig
from raytool.streaming import trajectory_stats
from raytool.tools.code_interpreter import CodeInterpreterTool
from raytool.tools.registry import ToolSet, load_tool_config
from raytool.types import Message, Trajectory


def build_toolset(agent: AgentConfig, tokenizer, executor) -> ToolSet:
    """The tools of a run: the verl-format YAML named by agent.tools, or the code interpreter alone."""
    if agent.tools:
        return load_tool_config(agent.tools, code_executor=executor, tokenizer=tokenizer, max_output_tokens=agent.tool_output_tokens)
    return ToolSet([CodeInterpreterTool(executor, tokenizer=tokenizer, max_output_tokens=agent.tool_output_tokens)])


@ray.remote
class AgentLoopWorker:
    def __init__(self, model_path: str, manager, sandbox_pools: list, reward_workers: list, cfg: RunConfig):
        from transformers import AutoTokenizer

        for module in cfg.agent.loop_modules:  # where users register their own loops and tools
            importlib.import_module(module)
        self.cfg = cfg
        self.manager = manager
        self.sandbox_pools = sandbox_pools
        self.reward_workers = itertools.cycle(reward_workers)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.toolset = build_toolset(cfg.agent, tokenizer, self._execute)
        self.renderer = ChatRenderer(tokenizer, tools=self.toolset.schemas if cfg.agent.format == "hermes" else None,
                                     template_kwargs=cfg.agent.chat_template_kwargs)
        self.slots = asyncio.Semaphore(cfg.agent.max_concurrent_trajectories)
        get_agent_loop(cfg.agent.default_agent)  # an unknown default fails now, not on the first row

    def _pool(self, session: str):
        # A stable hash: every cell of a trajectory reaches the pool that holds its session.
        return self.sandbox_pools[zlib.crc32(session.encode()) % len(self.sandbox_pools)]

    async def _execute(self, code: str, session: str):
        return await self._pool(session).execute.remote(code, session)

    async def _one(self, messages: list[Message], ground_truth: str, uid: str, group_id: str, agent_name: str,
                   extra: dict, rollout: RolloutConfig) -> Trajectory:
        async def generate(prompt_ids, sampling, request_id, session):
            return await self.manager.generate.remote(prompt_ids, sampling, request_id, session, group_id)

        loop = get_agent_loop(agent_name)(self.renderer, self.toolset.tools, generate, self.cfg.agent, rollout)
        async with self.slots:
            try:
                traj = await loop.run(messages, ground_truth, uid, group_id)
            finally:  # whatever happened, the trajectory's interpreter and routing state are released
                self.manager.end_session.remote(uid)
                self._pool(uid).close_session.remote(uid)
        traj.agent_name = agent_name
        # Score now, while sibling trajectories are still rolling out.
        traj.reward, traj.reward_extra = await next(self.reward_workers).score.remote(
            reward_view(traj, self.cfg.agent.max_response_tokens), ground_truth, extra)
        return traj

    @ray.method(num_returns=2)
    async def run_group(self, messages: list[Message], ground_truth: str, group_id: str, n: int, agent_name: str | None = None,
                        extra: dict | None = None, sampling: dict | None = None):
        """n samples of one prompt (a GRPO group) -> (trajectories, their small stats).
        `extra` goes to the reward fn (data_source, extra_info); `sampling` overrides rollout keys
        (validation samples with its own temperature)."""
        name = agent_name or self.cfg.agent.default_agent
        extra = extra or {}
        rollout = msgspec.structs.replace(self.cfg.rollout, **sampling) if sampling else self.cfg.rollout
        trajs = await asyncio.gather(*(self._one(messages, ground_truth, f"{group_id}/{i}", group_id, name, extra, rollout) for i in range(n)))
        return list(trajs), [trajectory_stats(t) for t in trajs]
