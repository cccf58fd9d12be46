"""What every engine shares (the engines import it, not the package, which imports them by name):
its counters and the refusal to serve half-loaded weights."""

from __future__ import annotations

import time

INCOMPLETE = -1  # the policy version of an engine whose last weight load failed half-way


def check_weights_complete(policy_version: int) -> None:
    """Refuse to serve from weights a failed load left half old, half new."""
    if policy_version == INCOMPLETE:
        raise RuntimeError("this engine's last weight load failed half-way: it serves nothing until a weight sync completes")


class EngineStats:
    """What an engine reports about itself: requests, generated tokens and throughput (counted by
    generate), queue sizes and prefix-cache counts (vLLM's stat-logger hook fills those)."""

    def __init__(self):
        self.running = 0
        self.waiting = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.generated_tokens = 0
        self.requests = 0
        self.first_request: float | None = None  # throughput counts from the first request on
        self.progress_at = time.monotonic()  # when the engine last produced tokens (a step, or a batch)

    def request_started(self) -> None:
        self.requests += 1
        self.first_request = self.first_request or time.monotonic()

    def progressed(self) -> None:
        self.progress_at = time.monotonic()

    def as_dict(self) -> dict:
        elapsed = time.monotonic() - self.first_request if self.first_request else 0.0
        return {
            "running": self.running,
            "waiting": self.waiting,
            "requests": self.requests,
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": self.generated_tokens / elapsed if elapsed else 0.0,
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else None,
        }
