"""A scripted judge behind a real OpenAI-compatible API: raytool's gateway (raytool.agent.gateway)
on a thread's event loop, whose scripted engine plays the judge model, answering each call after
`delay_s`. The slow-judge load bench (`raytool bench load --slow-stage judge`) and the judge tests
use it where a judge model is not the thing measured."""

from __future__ import annotations

import asyncio
import threading

from raytool.agent.gateway import Gateway
from raytool.agent.render import ChatRenderer
from raytool.types import SamplingParams, TokenOutput

JUDGE_MODEL = "judge-model"


class JudgeServer:
    """raytool's gateway on a thread's event loop, with a scripted engine as the judge model:
    `verdict(prompt_text) -> reply text`; counts the calls it answers. `with JudgeServer(...) as url`
    gives its API's base URL (`.../v1`)."""

    def __init__(self, tokenizer, verdict, delay_s: float = 0.0):
        self.renderer = ChatRenderer(tokenizer)
        self.verdict, self.delay_s, self.calls = verdict, delay_s, 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def generate(self, prompt_ids, sampling, request_id, session=None):
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        ids = self.renderer.encode(self.verdict(self.renderer.tokenizer.decode(prompt_ids))) + [self.renderer.eos_id]
        return TokenOutput(ids, [-0.1] * len(ids), "stop", policy_version=0)

    def __enter__(self) -> str:
        self.thread.start()
        self.gateway = Gateway(self.renderer, self.generate, model_name=JUDGE_MODEL, defaults=SamplingParams(max_tokens=64))
        return asyncio.run_coroutine_threadsafe(self.gateway.start(), self.loop).result(10) + "/v1"

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.gateway.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

