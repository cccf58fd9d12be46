"""`raytool bench engine`: rollout-engine decode speed on this CPU by engine dtype and preloaded
allocator / OpenMP runtime.

Each variant runs in a fresh process (LD_PRELOAD only applies to a new process, and vLLM's engine
core inherits it): the run's engine (model.path, rollout.engine) generates the default workload,
the task's rendered prompts x rollout.n at rollout.temperature with per-request seeds, all at once,
`ROUNDS` times after a warm-up round; the best round counts. Variants: fp32, bf16 and fp16 weights
with vLLM's own preload only (torch's libgomp), and fp32 and bf16 with what
`raytool.device.cpu_preloads` finds (tcmalloc, Intel OpenMP), alone and together. Ratios are
against fp32 without our preloads, measured in the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from raytool.config import RunConfig

ROUNDS = 3


def _worker(spec: dict) -> dict:
    """One variant, in this process: start the engine, warm up, time ROUNDS rounds."""
    import asyncio

    from raytool.agent.render import ChatRenderer
    from raytool.data import make_splits
    from raytool.data.tool_arith import prompt_row
    from raytool.engines import EngineOptions, make_engine
    from raytool.models import load_tokenizer, resolve_model
    from raytool.types import SamplingParams

    model_path = resolve_model(spec["model"])
    renderer = ChatRenderer(load_tokenizer(model_path))
    problems = make_splits(spec["prompts"], 1, seed=0)[0]
    prompts = [renderer.prompt_ids(prompt_row(p).prompt) for p in problems]
    started = time.perf_counter()
    options = EngineOptions(dtype=spec["dtype"], max_batch_size=spec["max_batch_size"], seed=0, enforce_eager=spec["eager"],
                            cpu_preload=False)  # the variant's LD_PRELOAD is set by the bench, not by the engine
    engine = make_engine(spec["engine"], model_path, options)
    start_s = time.perf_counter() - started

    async def round_(r: int) -> tuple[int, float]:
        t = time.perf_counter()
        outs = await asyncio.gather(*[
            engine.generate(p, SamplingParams(max_tokens=spec["max_tokens"], temperature=spec["temperature"], seed=1000 * r + i),
                            f"r{r}-{i}")
            for i, p in enumerate(p for p in prompts for _ in range(spec["n"]))])
        return sum(len(o.token_ids) for o in outs), time.perf_counter() - t

    async def main():
        await round_(0)
        return [await round_(r) for r in range(1, ROUNDS + 1)]

    try:
        rounds = asyncio.run(main())
    finally:
        engine.shutdown()
    best = max(tokens / s for tokens, s in rounds)
    return {"tokens_per_s": best, "tokens": rounds[0][0], "engine_start_s": start_s,
            "ld_preload": os.environ.get("LD_PRELOAD", "")}


def _variants(preloads: list[str]) -> list[tuple[str, str, list[str]]]:
    """(name, engine dtype, libraries to preload): each dtype bare and with all the preloads, and
    fp32 with each preload alone, so that each one's effect shows."""
    out = [("fp32", "float32", []), ("bf16", "bfloat16", []), ("fp16", "float16", [])]
    if len(preloads) > 1:
        out += [(f"fp32+{_short(lib)}", "float32", [lib]) for lib in preloads]
    if preloads:
        out += [("fp32+" + "+".join(map(_short, preloads)), "float32", preloads),
                ("bf16+" + "+".join(map(_short, preloads)), "bfloat16", preloads)]
    return out


def _short(lib: str) -> str:
    return "tcmalloc" if "tcmalloc" in lib else "iomp" if "iomp" in lib else os.path.basename(lib)


def bench(cfg: RunConfig) -> tuple[str, dict]:
    from raytool.device import cpu_bf16_support, cpu_preloads

    native, why = cpu_bf16_support()
    preloads = cpu_preloads()
    spec = {"model": cfg.model.path, "engine": cfg.rollout.engine, "prompts": cfg.data.prompts_per_step, "n": cfg.rollout.n,
            "max_tokens": cfg.rollout.max_tokens_per_turn, "temperature": cfg.rollout.temperature,
            "eager": cfg.rollout.enforce_eager, "max_batch_size": cfg.rollout.max_batch_size}
    results = {}
    for name, dtype, libs in _variants(preloads):
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        if libs:
            env["LD_PRELOAD"] = ":".join(libs)
        with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
            try:
                proc = subprocess.run([sys.executable, "-m", "raytool.bench.engine", json.dumps({**spec, "dtype": dtype}), out.name],
                                      env=env, capture_output=True, text=True, timeout=1800)
            except subprocess.TimeoutExpired:
                results[name] = {"error": "no result within 1800 s"}
                continue
            written = out.read()
        if not written:  # vLLM logs to stdout: the result goes to a file of its own
            results[name] = {"error": f"exit {proc.returncode}: " + ((proc.stderr + proc.stdout).strip().splitlines() or ["?"])[-1]}
            continue
        results[name] = json.loads(written)
    base = results["fp32"].get("tokens_per_s")
    result = {"cpu_bf16_native": native, "cpu_bf16_reason": why, "preloads": preloads,
              **{f"{name}_tokens_per_s": r.get("tokens_per_s") for name, r in results.items()}}
    for name, r in results.items():
        if base and r.get("tokens_per_s"):
            result[f"{name}_vs_fp32"] = r["tokens_per_s"] / base
    rows = [f"engine bench: {cfg.model.path} on {cfg.rollout.engine}, {spec['prompts']} prompts x {spec['n']}, "
            f"<= {spec['max_tokens']} tokens; bf16 native: {native} ({why})",
            f"{'variant':20} {'tokens/s':>9} {'vs fp32':>8}  LD_PRELOAD"]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"{name:20} failed: {r['error']}")
        else:
            rows.append(f"{name:20} {r['tokens_per_s']:9.1f} {r['tokens_per_s'] / base if base else float('nan'):8.2f}  "
                        f"{r['ld_preload'] or '-'}")
    return "\n".join(rows), result


if __name__ == "__main__":
    result = _worker(json.loads(sys.argv[1]))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
