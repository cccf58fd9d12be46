"""`raytool bench sandbox`: the local sandbox's cell latency and throughput against `python -c`.

Measured in one run, on the same machine, so the ratios hold on a noisy shared host:
- stateless cells (each in a fresh interpreter, thrown away after the cell), arriving at a steady
  `RATE_PER_S` as cells arrive from many concurrent trajectories, through `LocalBackend`, and the
  same cells through `subprocess.run([python, "-c", code])` (the skeleton's way, without isolation);
- the same cells back to back with no pause (`burst_p50_ms`: every cell then waits for a fork);
- throughput with `CONCURRENCY` cells in flight;
- cells in a live session (a trajectory's second and later cells).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from raytool.config import RunConfig, sandbox_backend_options
from raytool.sandbox.pool import percentile

CELLS = {
    "trivial": "print(1 + 1)",
    "numpy": "import numpy as np\nprint(np.linalg.solve(np.eye(3) * 2, np.ones(3)))",
    "sympy": "import sympy as sp\nx = sp.Symbol('x')\nprint(sp.factor(x**2 - 1))",
}
SAMPLES = 60  # cells per measurement
RATE_PER_S = 40.0  # arrival rate of the paced measurement
CONCURRENCY = 8
THROUGHPUT_CELLS = 200


async def _paced(run, code: str, n: int, rate: float) -> list[float]:
    """Latencies of n cells started every 1/rate s (or when the previous one ends, if later)."""
    out = []
    for _ in range(n):
        due = time.monotonic() + 1.0 / rate if rate else 0.0
        t = time.monotonic()
        result = await run(code)
        out.append(time.monotonic() - t)
        if result.status != "ok":
            raise RuntimeError(f"bench cell failed: {result.status}: {result.stderr[-300:]}")
        if rate:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
    return out


def _subprocess_latencies(code: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.monotonic()
        subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
        out.append(time.monotonic() - t)
    return out


async def _measure(cfg: RunConfig) -> dict:
    from raytool.sandbox.local import LocalBackend

    opts = sandbox_backend_options(cfg.sandbox) if cfg.sandbox.backend == "local" else {}
    backend = LocalBackend(**opts)
    t = time.monotonic()
    await backend.start()
    startup_s = time.monotonic() - t
    timeout = max(cfg.sandbox.timeout_s, 30.0)

    async def stateless(code):
        return await backend.run(code, timeout_s=timeout)

    try:
        await _paced(stateless, CELLS["trivial"], 10, RATE_PER_S)  # warm-up: page cache, first forks
        res: dict = {"startup_s": startup_s}
        for name, code in CELLS.items():
            lat = await _paced(stateless, code, SAMPLES, RATE_PER_S)
            res[f"{name}_p50_ms"], res[f"{name}_p99_ms"] = percentile(lat, 0.5) * 1e3, percentile(lat, 0.99) * 1e3
        burst = await _paced(stateless, CELLS["trivial"], SAMPLES, 0.0)
        res["burst_p50_ms"] = percentile(burst, 0.5) * 1e3

        t = time.monotonic()
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one():
            async with sem:
                return await stateless(CELLS["trivial"])

        results = await asyncio.gather(*[one() for _ in range(THROUGHPUT_CELLS)])
        res["execs_per_s"] = THROUGHPUT_CELLS / (time.monotonic() - t)
        res["throughput_failures"] = sum(r.status != "ok" for r in results)

        async def in_session(code):
            return await backend.run(code, session="bench", timeout_s=timeout)

        await in_session("x = 41")
        lat = await _paced(in_session, "x + 1", SAMPLES, 0.0)
        res["session_cell_p50_ms"] = percentile(lat, 0.5) * 1e3
        res["isolation"] = backend.stats()["isolation"]
    finally:
        await backend.aclose()

    for name in ("trivial", "numpy", "sympy"):
        lat = _subprocess_latencies(CELLS[name], SAMPLES // 3)
        res[f"baseline_{name}_p50_ms"] = percentile(lat, 0.5) * 1e3
    return res


def bench(cfg: RunConfig) -> tuple[str, dict]:
    m = asyncio.run(_measure(cfg))
    result = {
        "p50_ms": round(m["trivial_p50_ms"], 2),
        "p99_ms": round(m["trivial_p99_ms"], 2),
        "execs_per_s": round(m["execs_per_s"], 1),
        "baseline_p50_ms": round(m["baseline_trivial_p50_ms"], 2),
        "speedup_vs_subprocess": round(m["baseline_trivial_p50_ms"] / m["trivial_p50_ms"], 2),
        "session_cell_p50_ms": round(m["session_cell_p50_ms"], 3),
        "burst_p50_ms": round(m["burst_p50_ms"], 2),
        "numpy_p50_ms": round(m["numpy_p50_ms"], 2),
        "sympy_p50_ms": round(m["sympy_p50_ms"], 2),
        "baseline_numpy_p50_ms": round(m["baseline_numpy_p50_ms"], 2),
        "baseline_sympy_p50_ms": round(m["baseline_sympy_p50_ms"], 2),
        "speedup_numpy": round(m["baseline_numpy_p50_ms"] / m["numpy_p50_ms"], 2),
        "speedup_sympy": round(m["baseline_sympy_p50_ms"] / m["sympy_p50_ms"], 2),
        "throughput_failures": m["throughput_failures"],
        "startup_s": round(m["startup_s"], 2),
        "isolation": m["isolation"],
    }
    rows = [
        ("cell", "local p50 ms", "local p99 ms", "python -c p50 ms", "speedup"),
        ("trivial", result["p50_ms"], result["p99_ms"], result["baseline_p50_ms"], result["speedup_vs_subprocess"]),
        ("numpy", result["numpy_p50_ms"], round(m["numpy_p99_ms"], 2), result["baseline_numpy_p50_ms"], result["speedup_numpy"]),
        ("sympy", result["sympy_p50_ms"], round(m["sympy_p99_ms"], 2), result["baseline_sympy_p50_ms"], result["speedup_sympy"]),
    ]
    table = "\n".join(f"{a:<10}{b:>14}{c:>14}{d:>18}{e:>10}" for a, b, c, d, e in rows)
    table += (
        f"\n\nstateless cells arrive at {RATE_PER_S:g}/s; back to back (each waits for a fork): p50 {result['burst_p50_ms']} ms"
        f"\nthroughput ({CONCURRENCY} in flight, fresh interpreter each): {result['execs_per_s']} cells/s"
        f"\ncell in a live session: p50 {result['session_cell_p50_ms']} ms"
        f"\nfork-server start: {result['startup_s']} s; isolation: {', '.join(k for k, v in m['isolation'].items() if v) or 'none'}"
    )
    return table, result
