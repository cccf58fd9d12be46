"""vLLM's own OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`, what `vllm
serve` runs) in a process of its own on loopback, as a user starts a teacher or a judge: the real
server, not raytool's."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from helpers.net import free_port


@contextlib.contextmanager
def vllm_api(model: str, name: str, log: Path, max_model_len: int = 1024, start_timeout_s: float = 300.0):
    """The server's base URL (http://127.0.0.1:PORT/v1) while it serves `model` as `name`; its
    output goes to `log`. A 1 GiB KV cache and every core for its worker (vLLM's CPU defaults size
    the cache to most of the host's memory), eager execution."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", name,
                                 "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len), "--dtype", "float32",
                                 "--disable-log-stats", "--enforce-eager"],  # no compiled graphs: up in 27 s instead of 36 (tiny-random, 2026-11-30)
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with code {proc.returncode} before serving: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM's server did not serve within {start_timeout_s:.0f}s: {log.read_text()[-2000:]}") from None
                time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the API process and its engine core
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
