"""`raytool bench rollout`: what the actor graph costs on top of the engine, and whether tool
latency stalls generation.

One graph (rollout server(s), manager, agent worker, sandbox, reward), one run:
1. engine: the task's rendered prompts x n sent straight to the RolloutServer actors, all at once;
2. agent: the same prompts through the full agent-loop path (AgentLoopWorker -> LLMManager ->
   RolloutServer, reward scoring; one turn, so no tool runs). Both paths use the same per-request
   seeds, so they generate the same tokens; rounds alternate engine / agent so that prefix-cache
   warmth and machine noise hit both alike; tokens/s of each, and their ratio;
3. tools: trajectories of 4 turns through the manager with a fake tool between turns (3 calls),
   with 100 ms of tool latency and with 0 ms (after a warm-up run, in the order 0 / 100 / 100 / 0),
   with per-request seeds so every run generates the same tokens; the makespan ratio shows whether
   the engine keeps generating for other trajectories while some wait on a tool.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import ray

from actors.drivers.compose import build
from actors.drivers.session import connect
from raytool.config import RunConfig
from raytool.data import make_splits
from raytool.data.tool_arith import prompt_row
from raytool.agent.loop import request_seed
from raytool.types import SamplingParams

ROUNDS = 2
TOOL_TURNS = 4  # generate, tool, generate, tool, generate, tool, generate
OBSERVATION = [198, 33, 34, 35, 36, 198]  # a short fixed "tool output" appended between turns


def _engine_round(graph, prompts: list[list[int]], sampling: SamplingParams, prefix: str) -> tuple[int, float]:
    """The agent round's first turns, straight to the servers, with the very same sampling seeds
    (so both paths generate the same tokens and the time ratio is the graph's overhead)."""
    servers = list(graph.servers.values())
    n = graph.cfg.rollout.n
    seed = graph.cfg.rollout.seed
    start = time.perf_counter()
    refs = []
    for i, p in enumerate(prompts):
        uid = f"{prefix}{i // n}/{i % n}"  # the trajectory id Graph.rollout gives this sample
        s = msgspec.structs.replace(sampling, seed=request_seed(seed, uid, 0))
        refs.append(servers[i % len(servers)].generate.remote(p, s, f"e-{uid}"))
    tokens = sum(len(o.token_ids) for o in ray.get(refs))
    return tokens, time.perf_counter() - start


def _agent_round(graph, problems, prefix: str) -> tuple[int, float]:
    start = time.perf_counter()
    stats, _ = graph.rollout(problems, prefix)
    return sum(s.generated_tokens for s in stats), time.perf_counter() - start


async def _tool_trajectory(manager, prompt: list[int], sampling: SamplingParams, uid: str, index: int, latency_s: float) -> None:
    ids = list(prompt)
    for turn in range(TOOL_TURNS):
        turn_sampling = msgspec.structs.replace(sampling, seed=index * TOOL_TURNS + turn)  # same tokens in both runs
        out = await manager.generate.remote(ids, turn_sampling, f"{uid}-t{turn}", uid, None)
        ids += out.token_ids
        if turn < TOOL_TURNS - 1:
            await asyncio.sleep(latency_s)  # the tool runs; the engine should keep serving the others
            ids += OBSERVATION


def _tool_round(graph, prompts: list[list[int]], sampling: SamplingParams, latency_s: float, tag: str) -> float:
    async def all_of_them():
        await asyncio.gather(*(_tool_trajectory(graph.manager, p, sampling, f"{tag}-{i}", i, latency_s) for i, p in enumerate(prompts)))

    start = time.perf_counter()
    asyncio.run(all_of_them())
    return time.perf_counter() - start


def bench(cfg: RunConfig) -> tuple[str, dict]:
    from raytool.agent.render import ChatRenderer
    from raytool.models import load_tokenizer, resolve_model

    seed = cfg.rollout.seed if cfg.rollout.seed is not None else 0
    cfg = msgspec.structs.replace(cfg, agent=msgspec.structs.replace(cfg.agent, max_turns=1),
                                  rollout=msgspec.structs.replace(cfg.rollout, seed=seed))
    model_path = resolve_model(cfg.model.path)
    connect(cfg.cluster.address)
    graph = build(cfg, model_path, with_trainer=False)
    try:
        renderer = ChatRenderer(load_tokenizer(model_path))
        problems = [prompt_row(p, cfg.agent.system_prompt) for p in make_splits(cfg.data.prompts_per_step, 1, cfg.data.seed)[0]]
        n = cfg.rollout.n
        prompts = [renderer.prompt_ids(p.prompt) for p in problems for _ in range(n)]
        r = cfg.rollout
        sampling = r.sampling(stop_token_ids=(renderer.eos_id,))
        _agent_round(graph, problems, "warm")  # engine warm-up, compiled paths, prefix cache
        engine, agent = [0, 0.0], [0, 0.0]
        for k in range(ROUNDS):
            tokens, seconds = _engine_round(graph, prompts, sampling, f"a{k}g")
            engine[0] += tokens
            engine[1] += seconds
            tokens, seconds = _agent_round(graph, problems, f"a{k}g")
            agent[0] += tokens
            agent[1] += seconds
        tool_sampling = msgspec.structs.replace(sampling, max_tokens=max(8, r.max_tokens_per_turn // TOOL_TURNS))
        # Same seeds in every tool run, so each run after the first finds the same prefixes cached:
        # one warm-up run, then 0 / 100 / 100 / 0 ms so that drift hits both alike.
        _tool_round(graph, prompts, tool_sampling, 0.0, "tw")
        times = {0.0: 0.0, 0.1: 0.0}
        for k, latency in enumerate((0.0, 0.1, 0.1, 0.0)):
            times[latency] += _tool_round(graph, prompts, tool_sampling, latency, f"t{k}") / 2
        no_wait, wait = times[0.0], times[0.1]
    finally:
        graph.shutdown()
    result = {
        "engine_tokens_per_s": engine[0] / engine[1],
        "agent_tokens_per_s": agent[0] / agent[1],
        "agent_vs_engine": (agent[0] / agent[1]) / (engine[0] / engine[1]),
        "tool_makespan_0ms_s": no_wait,
        "tool_makespan_100ms_s": wait,
        "tool_latency_overhead": wait / no_wait,
        "trajectories": len(prompts),
        "engine": r.engine,
        "model": cfg.model.path,
    }
    table = "\n".join([
        f"rollout bench: {cfg.model.path} on {r.engine}, {r.num_servers} server(s), {len(prompts)} trajectories, {ROUNDS} rounds",
        f"{'path':<28}{'tokens/s':>10}",
        f"{'engine (RolloutServer)':<28}{result['engine_tokens_per_s']:>10.1f}",
        f"{'agent loop (full graph)':<28}{result['agent_tokens_per_s']:>10.1f}",
        f"agent_vs_engine {result['agent_vs_engine']:.3f}",
        f"tools: {TOOL_TURNS - 1} calls per trajectory, makespan 0 ms {no_wait:.2f}s, 100 ms {wait:.2f}s,"
        f" tool_latency_overhead {result['tool_latency_overhead']:.3f}",
    ])
    return table, result
