"""The scripted engine: no model; each request is answered after `delay_s` from a fixed script.

It stands behind real RolloutServers where a benchmark must measure raytool itself rather than a
model (`raytool bench load`). The script is a two-cell code-interpreter conversation in the
`retool` format, each request answered by the first script turn its prompt does not hold yet:
1. `<code>` x = 6 * 7; print(x) `</code>`
2. `<code>` print(x + 1) `</code>`   (the session's state carries over: the output is 43)
3. the answer, `\\boxed{43}`
each followed by the request's first stop token (finish reason `stop`). Token ids come from the
model's own tokenizer, so the agent loop parses, renders and masks them like any engine's.
Weight syncs are received for real (ZMQ) and discarded, so a training run works on it too.

`crash_with` ("Type: message") poisons it: every request then kills the engine with that error, the
way a vLLM engine dies of an exception in its worker (tests of `raytool.engines.crash`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os

from raytool.engines.common import EngineStats
from raytool.engines.crash import EngineCrash
from raytool.models import load_tokenizer
from raytool.types import SamplingParams, TokenOutput
from raytool.weightsync import WeightReceiver

log = logging.getLogger(__name__)

SCRIPT = (
    "Let me compute it.\n<code>\n```python\nx = 6 * 7\nprint(x)\n```\n</code>",
    "One more step.\n<code>\n```python\nprint(x + 1)\n```\n</code>",
    "The answer is \\boxed{43}.",
)
LOGPROB = -0.5  # every scripted token's log-prob


_tokenizer = functools.cache(load_tokenizer)  # one per model in a process


class ScriptedEngine:
    def __init__(self, model_path: str, *, delay_s: float = 0.5, crash_with: str | None = None):
        self.tokenizer = _tokenizer(model_path)
        self.turns = [self.tokenizer.encode(text, add_special_tokens=False) for text in SCRIPT]
        eos = self.tokenizer.eos_token_id
        self.default_stop = [eos] if eos is not None else []
        self.delay_s = delay_s
        self.policy_version = 0
        self.stats = EngineStats()
        self.busy_s = 0.0  # summed time of every request inside generate (the engine's share of a request's latency)
        self._receiver: WeightReceiver | None = None
        self.attestation = 0
        self.crash_with = crash_with
        self._crash: EngineCrash | None = None

    def turn_of(self, prompt_ids: list[int]) -> int:
        """Which script turn answers this prompt: the first one it does not hold yet."""
        text = self.tokenizer.decode(prompt_ids)
        turn = 0
        while turn < len(self.turns) - 1 and SCRIPT[turn] in text:
            turn += 1
        return turn

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> TokenOutput:
        if self.crash_with:
            kind, _, message = self.crash_with.partition(": ")
            self._crash = EngineCrash(kind, message, f"{self.crash_with} (a poisoned scripted engine, request {request_id})",
                                      f"scripted engine pid={os.getpid()}")
            raise RuntimeError(f"scripted engine: poisoned with {self.crash_with}")
        self.stats.request_started()
        self.stats.running += 1
        start = asyncio.get_running_loop().time()
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            return TokenOutput([], [], "abort", policy_version=self.policy_version)
        finally:
            self.stats.running -= 1
            self.busy_s += asyncio.get_running_loop().time() - start
        ids = list(self.turns[self.turn_of(prompt_ids)])[: sampling.max_tokens]
        stop = list(sampling.stop_token_ids) or self.default_stop
        finish = "length"
        if len(ids) < sampling.max_tokens and stop:
            ids.append(stop[0])
            finish = "stop"
        self.stats.generated_tokens += len(ids)
        self.stats.progressed()
        return TokenOutput(token_ids=ids, logprobs=[LOGPROB] * len(ids), finish_reason=finish, policy_version=self.policy_version)

    async def abort(self, request_id: str) -> bool:
        return False  # a scripted request holds no engine slot: a cancelled call just ends

    async def bind_weight_receivers(self, host: str) -> list[str]:
        if self._receiver is None:
            self._receiver = WeightReceiver(host)
        return [self._receiver.address]

    async def receive_weights(self, version: int, timeout_s: float, attempt: int = 0) -> int:
        def drain() -> int:
            return sum(len(list(bucket)) for bucket in self._receiver.receive(version, timeout_s, attempt))

        loaded = await asyncio.to_thread(drain)
        self.policy_version, self.attestation = version, self._receiver.attestation  # it loads nothing: what arrived, verified
        return loaded

    async def sleep(self) -> None:
        return None  # nothing held to release

    async def wake_up(self) -> None:
        return None

    async def pause(self) -> None:
        return None  # requests hold nothing a weight load could change

    async def resume(self) -> None:
        return None

    async def prompt_logprobs(self, prompt_ids: list[int]) -> list[float]:
        """LOGPROB for every token after the first (a scripted teacher scores every token alike)."""
        return [LOGPROB] * (len(prompt_ids) - 1)

    def engine_stats(self) -> dict:
        return {**self.stats.as_dict(), "policy_version": self.policy_version, "busy_s": self.busy_s}

    def dead(self, exc: BaseException | None = None) -> bool:
        return self._crash is not None

    def crash(self) -> EngineCrash | None:
        return self._crash

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
