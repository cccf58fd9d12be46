"""`raytool bench gateway`: an agent through the OpenAI-compatible gateway against raytool's own loop.

Both sides hold the same scripted multi-turn tool conversation (the scripted engine's: code, its
output, more code, its output, the answer; `rollout.scripted_delay_s` per call) on one engine in
this process, `TRAJECTORIES` trajectories `CONCURRENCY` at a time, one after the other in one run:
- native: `ToolAgentLoop` (retool format, tool messages), its code cells answered at once;
- gateway: a plain `openai.AsyncOpenAI` agent over HTTP on loopback, on per-trajectory URLs, that
  appends each reply and the same output as a tool message until the model answers.
Reported: `gateway_vs_native` (response tokens per second, gateway / native) and the gateway's
added latency per call (p50, p99: the client's time for a call minus the engine's for it), and of
that the gateway's own share (rendering, recording, parsing). Client and gateway share this
process's event loop and its cores, so the added latency includes the openai client's own work.
"""

from __future__ import annotations

import asyncio
import time

from raytool.config import RunConfig
from raytool.sandbox.pool import percentile

TRAJECTORIES = 64
CONCURRENCY = 16
OUTPUT = "42"


async def _timed(run, n: int, concurrency: int) -> tuple[float, list]:
    """`run(i)` for i < n, `concurrency` at a time -> (seconds, their results)."""
    slots = asyncio.Semaphore(concurrency)

    async def one(i):
        async with slots:
            return await run(i)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - start, results


async def _measure(cfg: RunConfig, trajectories: int, concurrency: int) -> dict:
    import msgspec
    import openai

    from raytool.agent.gateway import Gateway
    from raytool.agent.loop import ToolAgentLoop
    from raytool.agent.openai_loop import shared_http_client
    from raytool.agent.render import ChatRenderer
    from raytool.engines.scripted import ScriptedEngine
    from raytool.models import load_tokenizer, resolve_model
    from raytool.tools import CodeInterpreterTool
    from raytool.types import ExecResult, Message, SamplingParams

    model_path = resolve_model(cfg.model.path)
    engine = ScriptedEngine(model_path, delay_s=cfg.rollout.scripted_delay_s)
    tokenizer = load_tokenizer(model_path)
    renderer = ChatRenderer(tokenizer)
    engine_s: dict[str, float] = {}

    async def generate(prompt_ids, sampling, request_id, session):
        start = time.perf_counter()
        out = await engine.generate(prompt_ids, sampling, request_id)
        engine_s[request_id] = time.perf_counter() - start
        return out

    async def execute(code, session):
        return ExecResult(status="ok", stdout=OUTPUT + "\n", exit_code=0)

    agent = msgspec.structs.replace(cfg.agent, format="retool", observation_style="tool_message", max_turns=8)
    rollout = msgspec.structs.replace(cfg.rollout, max_tokens_per_turn=256)
    prompt = [Message("user", "What is 6 * 7 + 1? Use the code tool.")]
    tool = CodeInterpreterTool(execute, tokenizer=tokenizer)

    async def native(i: int):
        loop = ToolAgentLoop(renderer, {tool.name: tool}, generate, agent, rollout)
        return await loop.run(prompt, "43", f"n{i}", "n")

    gateway = Gateway(renderer, None, model_name="policy")
    await gateway.start()
    call_s: list[tuple[str, float]] = []

    async def through_gateway(i: int):
        path = gateway.open(f"g{i}", generate, sampling=SamplingParams(max_tokens=256))
        messages = [{"role": m.role, "content": m.content} for m in prompt]
        client = openai.AsyncOpenAI(base_url=gateway.url + path, api_key="x", max_retries=0, http_client=shared_http_client())
        for turn in range(agent.max_turns):
            start = time.perf_counter()
            reply = await client.chat.completions.create(model="policy", messages=messages)
            call_s.append((f"g{i}-{turn}.0", time.perf_counter() - start))
            content = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": content})
            if "<code>" not in content:
                break
            messages.append({"role": "tool", "content": OUTPUT})
        return gateway.finish(path, f"g{i}", "g", "43", content)

    try:
        await _timed(native, concurrency, concurrency)  # warm-up: the template's compilation, the openai package's lazy imports
        await _timed(through_gateway, concurrency, concurrency)
        call_s.clear()
        gateway.latencies.clear()
        native_s, native_trajs = await _timed(native, trajectories, concurrency)
        gateway_s, gateway_trajs = await _timed(through_gateway, trajectories, concurrency)
    finally:
        await gateway.stop()
    turns = {(t.num_turns, t.finish_reason) for t in native_trajs}, {(t.num_turns, t.finish_reason) for t in gateway_trajs}
    if turns != ({(3, "answer")}, {(3, "answer")}):
        raise RuntimeError(f"the two sides did not hold the same 3-turn conversation: native {turns[0]}, gateway {turns[1]}")
    tokens = sum(len(t.response_ids) for t in native_trajs), sum(len(t.response_ids) for t in gateway_trajs)
    added_ms = sorted(1000 * (s - engine_s[rid]) for rid, s in call_s)
    return {
        "trajectories": trajectories, "concurrency": concurrency, "engine_delay_s": cfg.rollout.scripted_delay_s,
        "native_tokens_per_s": tokens[0] / native_s, "gateway_tokens_per_s": tokens[1] / gateway_s,
        "gateway_vs_native": (tokens[1] / gateway_s) / (tokens[0] / native_s),
        "response_tokens_native": tokens[0], "response_tokens_gateway": tokens[1],
        "added_latency_p50_ms": percentile(added_ms, 0.5), "added_latency_p99_ms": percentile(added_ms, 0.99),
        "gateway_own_p50_ms": percentile([1000 * s for s in gateway.latencies], 0.5),
    }


def bench(cfg: RunConfig, trajectories: int = TRAJECTORIES, concurrency: int = CONCURRENCY) -> tuple[str, dict]:
    r = asyncio.run(_measure(cfg, trajectories, concurrency))
    rows = [
        f"{r['trajectories']} trajectories of 3 turns, {r['concurrency']} at a time, scripted engine {r['engine_delay_s']:g} s a call",
        f"{'':<28}{'tokens/s':>12}{'response tokens':>18}",
        f"{'native (ToolAgentLoop)':<28}{r['native_tokens_per_s']:>12.1f}{r['response_tokens_native']:>18}",
        f"{'gateway (openai, HTTP)':<28}{r['gateway_tokens_per_s']:>12.1f}{r['response_tokens_gateway']:>18}",
        f"gateway_vs_native {r['gateway_vs_native']:.3f}; the gateway's added latency per call: "
        f"p50 {r['added_latency_p50_ms']:.2f} ms, p99 {r['added_latency_p99_ms']:.2f} ms (of which rendering, recording and parsing "
        f"in the gateway: p50 {r['gateway_own_p50_ms']:.2f} ms; the rest is HTTP and the openai client, in this same process)",
    ]
    return "\n".join(rows), r
