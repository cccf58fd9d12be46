"""The HF transformers engine: batched `generate` behind the RolloutEngine protocol.

Requests that arrive while a batch runs wait and go out together in the next one (static
batching, grouped by sampling settings); each is cut at its own stop token or token budget.
It exists for fast tests and as a fallback; vLLM is the engine for real runs.
Log-probs are of each sampled token under the distribution it was drawn from (temperature, top-k
and top-p applied; the raw softmax when greedy). The model's own generation_config is not used:
only what SamplingParams says shapes sampling.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Iterable

import torch
from transformers import GenerationConfig

from raytool.engines.common import INCOMPLETE, EngineStats, check_weights_complete
from raytool.moe import RouterTap
from raytool.types import Routes, SamplingParams, TokenOutput
from raytool.weightsync import WeightReceiver
from raytool.weightsync.receiver import verify_loaded

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    request_id: str
    future: asyncio.Future = field(repr=False)

    @property
    def batch_key(self) -> tuple:
        s = self.sampling
        return (s.temperature, s.top_p, s.top_k, s.stop_token_ids)


def _routes_of(recorded: list[list[torch.Tensor]], row: int, rows: int, width: int, prompt_len: int, generated: int) -> Routes:
    """Request `row`'s routes from one batch's recording (per layer: the prefill's [rows * width, k]
    picks, then one [rows, k] per decoding step): its prompt's positions (left-padded), then each
    generated token but the last (which no forward has read yet)."""
    prefill = torch.stack([calls[0].view(rows, width, -1)[row, width - prompt_len:] for calls in recorded], dim=1)
    steps = [torch.stack([calls[t].view(rows, -1)[row] for calls in recorded], dim=0) for t in range(1, generated)]
    picks = torch.cat([prefill, torch.stack(steps)]) if steps else prefill
    return Routes.of(picks.cpu().numpy())


class HFEngine:
    def __init__(self, model_path: str, *, dtype: str = "float32", device: str = "cpu", max_batch_size: int = 64, seed: int = 0,
                 record_routes: bool = False):
        from transformers import AutoModelForCausalLM

        from raytool.errors import preflight_engine

        preflight_engine(model_path, "hf")
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype]).to(self.device).eval()
        eos = self.model.config.eos_token_id
        self.default_stop: list[int] = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        pad = self.model.config.pad_token_id
        self.pad_id = pad if pad is not None else self.default_stop[0]
        self.max_batch_size = max_batch_size
        self.policy_version = 0
        self.asleep = False
        self.paused = False
        self._pending: list[_Request] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._weights_lock = threading.RLock()  # a weight sync never overlaps a batch: each batch is of one version
        self._receiver: WeightReceiver | None = None
        self.attestation = 0  # the last sync's combined digest, as verified against the model's parameters
        self.stats = EngineStats()
        # trainer.router_replay=r3: the experts each prompt and generated token went to (raytool.moe)
        self.router_tap = RouterTap(self.model) if record_routes else None
        torch.manual_seed(seed)

    # -- generation ---------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> TokenOutput:
        if self.asleep:
            raise RuntimeError("HFEngine is asleep: call wake_up() before generate()")
        if sampling.stop:
            raise ValueError("the HF engine stops on token ids only; stop strings need rollout.engine=vllm")
        check_weights_complete(self.policy_version)
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.create_task(self._batch_loop())
        future = asyncio.get_running_loop().create_future()
        self.stats.request_started()
        self._pending.append(_Request(list(prompt_ids), sampling, request_id, future))
        self._wakeup.set()
        return await future

    async def _batch_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending and not self.asleep and not self.paused:  # queued requests wait for wake_up() / resume()
                key = self._pending[0].batch_key
                batch = [r for r in self._pending if r.batch_key == key][: self.max_batch_size]
                taken = {id(r) for r in batch}
                self._pending = [r for r in self._pending if id(r) not in taken]
                try:
                    outputs = await asyncio.to_thread(self._generate_batch, batch)
                except Exception as exc:  # every waiter learns why its request failed
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(exc)
                    continue
                self.stats.progressed()
                for r, out in zip(batch, outputs):
                    self.stats.generated_tokens += len(out.token_ids)
                    if not r.future.done():
                        r.future.set_result(out)

    @torch.no_grad()
    def _generate_batch(self, batch: list[_Request]) -> list[TokenOutput]:
        s = batch[0].sampling
        width = max(len(r.prompt_ids) for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every prompt ends where generation starts
            input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            attention[i, width - len(r.prompt_ids):] = 1
        stop_ids = list(s.stop_token_ids) or self.default_stop
        greedy = s.temperature <= 0
        config = GenerationConfig(
            max_new_tokens=max(r.sampling.max_tokens for r in batch),
            do_sample=not greedy,
            eos_token_id=stop_ids,
            pad_token_id=self.pad_id,
            output_scores=True,  # the scores after temperature / top-k / top-p: what was sampled from
            return_dict_in_generate=True,
        )
        if not greedy:
            config.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else 0)
        with self._weights_lock:
            version = self.policy_version
            check_weights_complete(version)
            if self.router_tap is not None:
                self.router_tap.start_recording()
            try:
                out = self.model.generate(
                    input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device), generation_config=config
                )
            finally:
                recorded = self.router_tap.stop_recording() if self.router_tap is not None else None
        new = out.sequences[:, width:].cpu()
        logprobs = torch.stack(
            [torch.log_softmax(step.float(), -1).gather(-1, new[:, t : t + 1].to(step.device)).squeeze(-1).cpu()
             for t, step in enumerate(out.scores)],
            dim=1,
        )
        results = []
        stops = set(stop_ids)
        for i, r in enumerate(batch):
            ids = new[i].tolist()[: r.sampling.max_tokens]
            finish = "length"
            for t, tok in enumerate(ids):
                if tok in stops:
                    ids, finish = ids[: t + 1], "stop"
                    break
            routes = _routes_of(recorded, i, len(batch), width, len(r.prompt_ids), len(ids)) if recorded is not None else None
            results.append(
                TokenOutput(token_ids=ids, logprobs=logprobs[i, : len(ids)].tolist(), finish_reason=finish, policy_version=version,
                            routes=routes)
            )
        return results

    async def abort(self, request_id: str) -> bool:
        """Abort a request that has not started; a request inside a running batch finishes normally."""
        for r in self._pending:
            if r.request_id == request_id:
                self._pending.remove(r)
                r.future.set_result(TokenOutput([], [], "abort", policy_version=self.policy_version))
                return True
        return False

    # -- weights and memory --------------------------------------------------------------------

    async def bind_weight_receivers(self, host: str) -> list[str]:
        if self._receiver is None:
            self._receiver = WeightReceiver(host)
        return [self._receiver.address]

    async def receive_weights(self, version: int, timeout_s: float, attempt: int = 0) -> int:
        """Take one sync from the trainer, bucket by bucket, between batches: the whole sync and the
        version change under the weights lock, so every batch runs on one version's weights."""

        def receive() -> int:
            with self._weights_lock:
                try:
                    loaded = sum(self.load_weights(bucket) for bucket in self._receiver.receive(version, timeout_s, attempt))
                    # What the model holds now, against what the trainer sent: parameters by their HF names.
                    verify_loaded(self._receiver.manifest, {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())},
                                  version, self._receiver.on_host)
                except BaseException:
                    self.policy_version = INCOMPLETE  # half old, half new: serve nothing until a sync completes
                    raise
                self.policy_version, self.attestation = version, self._receiver.attestation
            return loaded

        return await asyncio.to_thread(receive)

    async def prompt_logprobs(self, prompt_ids: list[int]) -> list[float]:
        """log p(prompt[t] | prompt[:t]) for t >= 1 under the weights the engine holds (one forward)."""

        def score() -> list[float]:
            with self._weights_lock, torch.no_grad():
                check_weights_complete(self.policy_version)
                ids = torch.tensor([prompt_ids], device=self.device)
                logits = self.model(input_ids=ids).logits[0, :-1].float()
                return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()

        return await asyncio.to_thread(score)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the model by HF parameter name; returns how many were loaded."""
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        loaded = 0
        with self._weights_lock, torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"weight '{name}' does not exist in the rollout model")
                params[name].copy_(tensor.to(params[name].dtype))
                loaded += 1
        return loaded

    async def sleep(self) -> None:
        """Release accelerator memory (weights move to host); generate() is refused until wake_up().

        Call it between rollout phases: requests already queued still run, after wake_up()."""
        self.asleep = True
        if self.device.type != "cpu":
            with self._weights_lock:  # not under a running batch
                self.model.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def engine_stats(self) -> dict:
        self.stats.waiting = len(self._pending)
        return {**self.stats.as_dict(), "policy_version": self.policy_version}

    def dead(self, exc: BaseException | None = None) -> bool:
        """The model runs in this process: it cannot die while the actor lives."""
        return False

    def crash(self) -> None:
        return None

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.close()

    async def pause(self) -> None:
        """New batches wait for resume(); a batch already running finishes."""
        self.paused = True

    async def resume(self) -> None:
        self.paused = False
        if self._wakeup is not None:
            self._wakeup.set()

    async def wake_up(self) -> None:
        if self.device.type != "cpu":
            with self._weights_lock:
                self.model.to(self.device)
        self.asleep = False
        if self._wakeup is not None:
            self._wakeup.set()
