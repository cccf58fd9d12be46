"""The Tinker API's service, without HTTP (raytool.tinker.server speaks it): sessions, training
models, sampling sessions, futures and checkpoints, over raytool's trainer (raytool.training:
`Trainer.forward_backward` / `optim_step`, its LoRA, its checkpoints) and a rollout engine
(raytool.engines) per base model, all in this process.

Every call that the client treats as a future (create_model, forward_backward, optim_step, the
saves and loads, sample) is queued and answered at once with a request id; `retrieve` waits for it.
A training model's calls run one at a time in the order they arrived (the client sends them in its
own order, one after the other). A sampler samples from the weights it was created with: the engine
of its base model loads them when they are not the ones it holds (no request in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import msgspec
import torch

from raytool.algos.datum_losses import DATUM_LOSSES
from raytool.config import RunConfig
from raytool.tinker.errors import Refused, Unknown
from raytool.tinker.wire import ForwardBackward, encode_forward_backward_output, encode_sample_response
from raytool.types import SamplingParams

log = logging.getLogger(__name__)

# The LoRA placements the client asks for, as module names of the decoder (Llama, Qwen, Mistral ...).
_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
_MLP = ["gate_proj", "up_proj", "down_proj"]
BASE = ""  # the snapshot key of a base model's own weights
HELD_SNAPSHOTS = 2  # sampler weights kept in host memory (the latest): a swap back to one of them reads no file
SWAP_TIMEOUT_S = 300.0  # a swap of sampler weights into an engine that takes longer has failed


@dataclass
class _Session:
    id: str
    seen: float
    models: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)


@dataclass
class _Model:
    id: str
    session: str
    base: str
    lora: dict | None  # the client's LoraConfig (None: full weights)
    trainer: Any  # raytool.training.Trainer
    saves: int = 0


@dataclass
class _Sampler:
    id: str
    session: str
    base: str
    snapshot: str  # a sampler_weights tinker path, or BASE
    path: str | None  # the model_path it was created from (None: the base model, or an ephemeral save)


@dataclass
class _Engine:
    engine: Any
    loaded: str | None = BASE  # the snapshot it holds (None: a swap is under way, or failed)
    in_flight: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    sender: Any = None  # raytool.weightsync.sender.WeightSender to its receivers, made at its first swap
    version: int = 0


@dataclass
class Result:
    """A finished request: a JSON object, or protobuf bytes (ForwardBackwardOutput, SampleResponse)."""

    body: dict | bytes


class TinkerService:
    """`models`: the base models it serves, by the name clients ask for -> a local HF directory.
    `root`: where checkpoints (tinker://<model>/weights/<name>) and sampler weights
    (tinker://<model>/sampler_weights/<name>) are written. `cfg`: the trainer settings every training
    model starts from (compute dtype, micro-batch budget, LoRA alpha ...); `engine`: the rollout
    engine of the samplers (default rollout.engine)."""

    def __init__(self, models: dict[str, str], root: str | Path, cfg: RunConfig, *, engine: str | None = None, session_ttl_s: float = 600.0,
                 max_training_models: int = 4, poll_s: float = 20.0, device: str | None = None):
        from raytool.device import detect

        self.models, self.root, self.cfg = dict(models), Path(root), cfg
        self.device = device or detect().kind  # the trainers' and the engines' (a GPU or NPU where this process has one)
        self.engine_name = engine or cfg.rollout.engine
        if self.engine_name not in ("vllm", "hf"):
            raise ValueError(f"config key 'rollout.engine': the Tinker service samples with vllm or hf, not '{self.engine_name}'")
        self.session_ttl_s, self.max_training_models, self.poll_s = session_ttl_s, max_training_models, poll_s
        self.root.mkdir(parents=True, exist_ok=True)
        self.sessions: dict[str, _Session] = {}
        self.training: dict[str, _Model] = {}
        self.samplers: dict[str, _Sampler] = {}
        self.engines: dict[str, _Engine] = {}
        self.futures: dict[str, asyncio.Future] = {}
        self._held: OrderedDict[str, tuple[dict, dict, bool]] = OrderedDict()  # snapshot -> (tensors, meta, unwritten)
        self._held_lock = threading.Lock()
        self._train = ThreadPoolExecutor(1, thread_name_prefix="tinker-train")  # a model's calls in arrival order
        self._load = ThreadPoolExecutor(1, thread_name_prefix="tinker-load")  # engine starts and weight swaps

    # -- sessions --------------------------------------------------------------------------------

    def create_session(self) -> str:
        sid = f"session-{uuid.uuid4().hex[:12]}"
        self.sessions[sid] = _Session(sid, time.monotonic())
        return sid

    def session(self, sid: str) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            raise Unknown(f"unknown session '{sid}' (never created here, or released after {self.session_ttl_s:.0f} s without calls)")
        s.seen = time.monotonic()
        return s

    def release_idle(self) -> list[str]:
        """Release the sessions with no call for session_ttl_s: their training models and samplers go."""
        now = time.monotonic()
        gone = [s for s in self.sessions.values() if now - s.seen > self.session_ttl_s]
        for s in gone:
            self._release(s, f"after {now - s.seen:.0f} s without calls (--session-ttl {self.session_ttl_s:g})", logging.WARNING)
        return [s.id for s in gone]

    def finish(self, sid: str) -> None:
        """The client ended its session: release it now."""
        if sid in self.sessions:
            self._release(self.sessions[sid], "its client finished it", logging.INFO)

    def _release(self, s: _Session, why: str, level: int) -> None:
        for mid in s.models:
            self.training.pop(mid, None)
        for sid in s.samplers:
            self.samplers.pop(sid, None)
        del self.sessions[s.id]
        log.log(level, "tinker: released session %s, %s (%d training models, %d samplers)",
                s.id, why, len(s.models), len(s.samplers))

    def model(self, mid: str) -> _Model:
        m = self.training.get(mid)
        if m is None:
            raise Unknown(f"unknown model_id '{mid}' (not created here, or its session was released)")
        self.session(m.session)
        return m

    def base_path(self, name: str) -> str:
        if name not in self.models:
            raise Unknown(f"base model '{name}' is not served here; served: {sorted(self.models)}")
        return self.models[name]

    # -- futures ---------------------------------------------------------------------------------

    def submit(self, work: Callable[[], Any]) -> str:
        """Queue `work` on the training thread (in arrival order); returns its request id."""
        return self.submit_async(asyncio.get_running_loop().run_in_executor(self._train, work))

    def submit_async(self, coro) -> str:
        """Run `coro` (or a future) as a request; returns its request id."""
        rid = f"req-{uuid.uuid4().hex}"
        self.futures[rid] = asyncio.ensure_future(coro)
        return rid

    async def retrieve(self, rid: str) -> dict | Result:
        """The request's result, or `try_again` after poll_s; a failure as the client's
        RequestFailedResponse (category user for a refusal, server otherwise)."""
        fut = self.futures.get(rid)
        if fut is None:
            raise Unknown(f"unknown request_id '{rid}'")
        try:
            value = await asyncio.wait_for(asyncio.shield(fut), self.poll_s)
        except asyncio.TimeoutError:
            return {"type": "try_again", "request_id": rid, "queue_state": "active"}
        except Refused as exc:
            self.futures.pop(rid, None)
            return {"error": str(exc), "category": "user"}
        except Exception as exc:  # noqa: BLE001 - the request failed: the client raises RequestFailedError with this line
            self.futures.pop(rid, None)
            log.exception("tinker: request %s failed", rid)
            return {"error": f"{type(exc).__name__}: {exc}", "category": "server"}
        self.futures.pop(rid, None)
        return value if isinstance(value, Result) else Result(value)

    # -- training models -------------------------------------------------------------------------

    def _trainer_config(self, lora: dict | None, seed: int | None) -> RunConfig:
        t = self.cfg.trainer
        changes: dict = {"lora_rank": 0}
        if lora is not None:
            modules = (_ATTENTION if lora.get("train_attn", True) else []) + (_MLP if lora.get("train_mlp", True) else [])
            if not modules:
                raise Refused("lora_config: raytool adapts attention and MLP layers; train_attn and train_mlp are both false, "
                              "and the unembedding alone (train_unembed) is not adapted here")
            changes = {"lora_rank": int(lora["rank"]), "lora_target_modules": modules}
        if seed is not None:
            changes["seed"] = int(seed)
        return msgspec.structs.replace(self.cfg, trainer=msgspec.structs.replace(t, **changes))

    def _new_trainer(self, base: str, lora: dict | None, seed: int | None):
        from raytool.training import Trainer

        return Trainer(self._trainer_config(lora, seed), self.base_path(base), device=self.device)

    def _model_id(self, s: _Session, seq: int) -> str:
        """The client's own name for its model_seq_id-th training model (it derives it when it creates one from a checkpoint)."""
        mid = f"{s.id}:train:{int(seq)}"
        if mid in self.training:
            raise Refused(f"model_seq_id {seq} of session {s.id} is taken by a model already")
        return mid

    def create_model(self, session_id: str, seq: int, base: str, lora: dict | None) -> str:
        s = self.session(session_id)
        self.base_path(base)
        if lora is not None and int(lora.get("rank", 0)) <= 0:
            raise Refused(f"lora_config.rank must be positive, got {lora.get('rank')}")
        self._check_room()
        if lora is not None and lora.get("train_unembed", True):
            log.info("tinker: LoRA on attention and MLP layers; the unembedding is not adapted (train_unembed)")
        mid = self._model_id(s, seq)
        seed = (lora or {}).get("seed")

        def build():
            self.training[mid] = _Model(mid, s.id, base, lora, self._new_trainer(base, lora, seed))
            s.models.add(mid)
            return {"model_id": mid, "type": "create_model"}

        return self.submit(build)

    def _check_room(self) -> None:
        if len(self.training) >= self.max_training_models:
            raise Refused(f"{len(self.training)} training models are loaded, the most this service holds (tinker.max_training_models="
                          f"{self.max_training_models}): end a session or wait for an idle one to be released")

    def info(self, mid: str) -> dict:
        m = self.model(mid)
        lm = m.trainer.lm.config
        return {"type": "get_info", "model_id": mid, "model_name": m.base, "is_lora": m.lora is not None,
                "lora_rank": m.lora["rank"] if m.lora else None,
                "model_data": {"arch": getattr(lm, "model_type", None), "model_name": m.base, "tokenizer_id": self.models[m.base]}}

    def forward_backward(self, req: ForwardBackward) -> str:
        m = self.model(req.model_id)
        fn = DATUM_LOSSES.get(req.loss_fn)
        if fn is None:
            raise Refused(f"loss_fn '{req.loss_fn}' is not served here; served: {sorted(DATUM_LOSSES)} "
                          "(forward_backward_custom runs a loss of your own on the client)")
        unknown = sorted(set(req.config) - set(fn.config))
        if unknown:
            raise Refused(f"loss_fn_config key(s) {unknown} are not taken by loss '{req.loss_fn}'; it takes {sorted(fn.config) or 'none'}")
        needed = [k for k, v in fn.config.items() if v is None and k not in req.config]
        if needed:
            raise Refused(f"loss '{req.loss_fn}' needs loss_fn_config key(s) {needed}")
        if not req.data:
            raise Refused("forward_backward: no data")
        vocab = m.trainer.lm.config.vocab_size
        names = None
        for row, d in enumerate(req.data):
            missing = [k for k in fn.inputs if k not in d.inputs]
            if missing:
                raise Refused(f"datum {row}: loss '{req.loss_fn}' needs loss_fn_inputs {list(fn.inputs)}; missing {missing}")
            own = set(d.inputs) - set(fn.fill)
            if names is not None and own != names:
                raise Refused(f"datum {row}: loss_fn_inputs {sorted(own)} differ from datum 0's {sorted(names)}")
            names = own
            bad = next((t for t in (*d.tokens, *d.targets) if not 0 <= t < vocab), None)
            if bad is not None:
                raise Refused(f"datum {row}: token id {bad} is outside the vocabulary of '{m.base}' ({vocab} ids)")

        def run():
            logprobs, metrics = m.trainer.forward_backward(req.data, req.loss_fn, req.config, backward=not req.forward_only)
            return Result(encode_forward_backward_output(logprobs, metrics))

        return self.submit(run)

    def optim_step(self, mid: str, adam: dict) -> str:
        m = self.model(mid)
        kind = adam.get("type")
        if kind not in (None, "adamw", "adam"):
            raise Refused(f"optim_step: optimizer '{kind}' is not served here; raytool trains with Adam (AdamParams)")
        lr = float(adam.get("learning_rate", 1e-4))
        if not math.isfinite(lr) or lr < 0:
            raise Refused(f"optim_step: learning_rate must be a finite number >= 0, got {lr}")

        def run():
            metrics = m.trainer.optim_step(lr, betas=(float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95))),
                                           eps=float(adam.get("eps", 1e-12)), weight_decay=float(adam.get("weight_decay", 0.0)),
                                           grad_clip=float(adam.get("grad_clip_norm", 0.0)))
            return {"type": "optim_step", "metrics": metrics}

        return self.submit(run)

    # -- checkpoints -----------------------------------------------------------------------------

    def _local(self, tinker_path: str, kind: str) -> Path:
        """tinker://<model>/<kind>/<name> -> its directory under root (refused when malformed)."""
        parts = tinker_path[len("tinker://"):].split("/") if tinker_path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] != kind or not all(parts) or any(p in (".", "..") for p in parts):
            raise Refused(f"'{tinker_path}' is not a tinker://<model_id>/{kind}/<name> path")
        return self.root.joinpath(*parts)

    def _name(self, name: str | None, m: _Model, what: str) -> str:
        if name is None:
            m.saves += 1
            return f"{what}-{m.saves:06d}-{uuid.uuid4().hex[:6]}"
        if "/" in name or name in (".", "..") or not name:
            raise Refused(f"checkpoint name '{name}' must be a single path segment")
        return name

    def save_state(self, mid: str, name: str | None, ttl_seconds: int | None) -> str:
        m = self.model(mid)
        path = f"tinker://{mid}/weights/{self._name(name, m, 'state')}"
        where = self._local(path, "weights")

        def run():
            m.trainer.save_checkpoint(where)
            meta = {"base_model": m.base, "lora": m.lora, "ttl_seconds": ttl_seconds, "saved_at": time.time()}
            (where / "tinker.json").write_text(json.dumps(meta))
            return {"type": "save_weights", "path": path}

        return self.submit(run)

    def _saved(self, path: str, kind: str) -> tuple[Path, dict]:
        """The directory of a saved tinker://<model>/<kind>/<name> and its tinker.json (Unknown when none is there)."""
        where = self._local(path, kind)
        meta_file = where / "tinker.json"
        if not meta_file.is_file():
            writer = "save_state" if kind == "weights" else "save_weights_for_sampler"
            raise Unknown(f"nothing saved at '{path}' ({writer} writes there)")
        return where, json.loads(meta_file.read_text())

    def load_state(self, mid: str, path: str, optimizer: bool) -> str:
        m = self.model(mid)
        where, meta = self._saved(path, "weights")
        if meta["base_model"] != m.base or (meta["lora"] or {}).get("rank") != (m.lora or {}).get("rank"):
            raise Refused(f"'{path}' holds {meta['base_model']} (LoRA rank {(meta['lora'] or {}).get('rank')}); model {mid} is {m.base} "
                          f"(LoRA rank {(m.lora or {}).get('rank')}): create a training client from the checkpoint instead")

        def run():
            self._restore(m.trainer, where, optimizer)
            return {"type": "load_weights", "path": path}

        return self.submit(run)

    @staticmethod
    def _restore(trainer, where: Path, optimizer: bool) -> None:
        trainer.load_checkpoint(where)
        if not optimizer:  # the weights only: a fresh Adam state
            trainer.optimizer = trainer._new_optimizer()

    def create_from_state(self, session_id: str, seq: int, path: str, optimizer: bool, base: str | None) -> str:
        s = self.session(session_id)
        where, meta = self._saved(path, "weights")
        base = base or meta["base_model"]
        if base != meta["base_model"]:
            raise Refused(f"'{path}' was trained from '{meta['base_model']}', not '{base}'")
        self.base_path(base)
        self._check_room()
        mid = self._model_id(s, seq)

        def run():
            trainer = self._new_trainer(base, meta["lora"], None)
            self._restore(trainer, where, optimizer)
            self.training[mid] = _Model(mid, s.id, base, meta["lora"], trainer)
            s.models.add(mid)
            return {"type": "load_weights", "path": path, "model_id": mid}

        return self.submit(run)

    # -- samplers --------------------------------------------------------------------------------

    def save_for_sampler(self, mid: str, name: str | None, ttl_seconds: int | None) -> str:
        """Snapshot the model's weights (LoRA merged) for samplers: under `name` a persistent
        tinker://<model>/sampler_weights/<name>; without one an ephemeral snapshot and a sampler of it.
        The latest snapshots stay in host memory (an ephemeral one is written out only when it leaves)."""
        m = self.model(mid)
        path = f"tinker://{mid}/sampler_weights/{self._name(name, m, 'sampler')}"
        self._local(path, "sampler_weights")

        def run():
            tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in m.trainer.named_weights()}
            meta = {"base_model": m.base, "ephemeral": name is None, "ttl_seconds": ttl_seconds}
            if name is not None:
                self._write(path, tensors, meta)
            self._hold(path, tensors, meta, written=name is not None)
            if name is not None:
                return {"type": "save_weights_for_sampler", "path": path}
            sid = self._new_sampler(self.sessions[m.session], m.base, path, None)
            return {"type": "save_weights_for_sampler", "sampling_session_id": sid}

        return self.submit(run)

    def _hold(self, snapshot: str, tensors: dict, meta: dict, *, written: bool) -> None:
        """Keep `snapshot` in memory, the last HELD_SNAPSHOTS of them; one that leaves unwritten is written out."""
        with self._held_lock:
            self._held[snapshot] = (tensors, meta, not written)
            self._held.move_to_end(snapshot)
            leaving = [self._held.popitem(last=False) for _ in range(len(self._held) - HELD_SNAPSHOTS)]
        for key, (t, meta_of, unwritten) in leaving:
            if unwritten:
                self._write(key, t, meta_of)

    def _write(self, snapshot: str, tensors: dict, meta: dict) -> None:
        from safetensors.torch import save_file

        where = self._local(snapshot, "sampler_weights")
        where.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(where / "model.safetensors"))
        (where / "tinker.json").write_text(json.dumps(meta))

    def _new_sampler(self, s: _Session, base: str, snapshot: str, path: str | None) -> str:
        sid = f"sampler-{uuid.uuid4().hex[:12]}"
        self.samplers[sid] = _Sampler(sid, s.id, base, snapshot, path)
        s.samplers.add(sid)
        return sid

    def create_sampler(self, session_id: str, base: str | None, model_path: str | None) -> str:
        s = self.session(session_id)
        if model_path:
            snapshot, (_, meta) = model_path, self._saved(model_path, "sampler_weights")
            if base and base != meta["base_model"]:
                raise Refused(f"'{model_path}' holds weights of '{meta['base_model']}', not '{base}'")
            return self._new_sampler(s, meta["base_model"], snapshot, model_path)
        if not base:
            raise Refused("create_sampling_session: give base_model or model_path")
        self.base_path(base)
        return self._new_sampler(s, base, BASE, None)

    def sampler(self, sid: str) -> _Sampler:
        sp = self.samplers.get(sid)
        if sp is None:
            raise Unknown(f"unknown sampling_session_id '{sid}' (not created here, or its session was released)")
        self.session(sp.session)
        return sp

    def sampler_info(self, sid: str) -> dict:
        sp = self.sampler(sid)
        return {"sampler_id": sid, "base_model": sp.base, "model_path": sp.path}

    def _engine_now(self, base: str) -> _Engine:
        """The rollout engine of `base` (made on first use: rollout.engine, on this process's device)."""
        if base not in self.engines:
            from raytool.device import engine_dtype
            from raytool.engines import EngineOptions, make_engine

            dtype, _ = engine_dtype(self.cfg.model.dtype, self.device != "cpu", self.engine_name)
            options = EngineOptions(seed=self.cfg.trainer.seed, device=self.device, dtype=dtype)
            self.engines[base] = _Engine(make_engine(self.engine_name, self.base_path(base), options))
        return self.engines[base]

    def _weights(self, base: str, snapshot: str) -> Iterator[tuple[str, torch.Tensor]]:
        """`snapshot`'s weights (BASE: the model directory's own): from memory where they are held,
        else from their files."""
        from safetensors.torch import load_file

        with self._held_lock:
            held = self._held.get(snapshot)
            if held is not None:
                self._held.move_to_end(snapshot)
        if held is not None:
            yield from held[0].items()
            return
        if snapshot == BASE:
            files = sorted(Path(self.base_path(base)).glob("*.safetensors"))
        else:
            files = [self._local(snapshot, "sampler_weights") / "model.safetensors"]
        for f in files:
            yield from load_file(str(f)).items()

    async def _swap(self, e: _Engine, base: str, snapshot: str) -> None:
        """Load `snapshot`'s weights into the engine by raytool's weight sync (the engine's own
        receivers, as a trainer's sync reaches a rollout server), each swap a new version."""
        from raytool.weightsync.sender import WeightSender

        loop = asyncio.get_running_loop()
        if e.sender is None:
            e.sender = WeightSender(await e.engine.bind_weight_receivers("127.0.0.1"), send_timeout_s=SWAP_TIMEOUT_S)
        e.version += 1
        receiving = asyncio.ensure_future(e.engine.receive_weights(e.version, SWAP_TIMEOUT_S))
        sending = loop.run_in_executor(self._load, lambda: e.sender.send(self._weights(base, snapshot), e.version))
        await asyncio.gather(receiving, sending)

    @contextlib.asynccontextmanager
    async def _holding(self, base: str, snapshot: str):
        """The engine of `base` holding `snapshot`'s weights for the length of the block."""
        loop = asyncio.get_running_loop()
        if base not in self.engines:
            await loop.run_in_executor(self._load, self._engine_now, base)
        e = self.engines[base]
        async with e.changed:
            while e.loaded != snapshot and e.in_flight:
                await e.changed.wait()
            if e.loaded != snapshot:
                e.loaded = None  # until the swap completes: a failed one leaves no sampler believing it holds its weights
                await self._swap(e, base, snapshot)
                e.loaded = snapshot
            e.in_flight += 1
        try:
            yield e.engine
        finally:
            async with e.changed:
                e.in_flight -= 1
                e.changed.notify_all()

    def sample(self, req: dict) -> tuple[str, list[str]]:
        """An `asample` request -> (request id, the sequence id of each sample)."""
        if req.get("sampling_session_id"):
            sp = self.sampler(req["sampling_session_id"])
            base, snapshot = sp.base, sp.snapshot
        elif req.get("model_path"):
            snapshot, (_, meta) = req["model_path"], self._saved(req["model_path"], "sampler_weights")
            base = meta["base_model"]
        elif req.get("base_model"):
            base, snapshot = req["base_model"], BASE
            self.base_path(base)
        else:
            raise Refused("sample: give sampling_session_id, model_path or base_model")
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if req.get(key):
                raise Refused(f"sample: {key} is not served here (raytool returns each token's own log-prob; prompt_logprobs=True for the prompt's)")
        for key in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
            if req.get(key) is not None:
                raise Refused(f"sample: {key} is not served here; prompt_logprobs=True scores the whole prompt")
        prompt = _prompt_tokens(req["prompt"])
        n = int(req.get("num_samples", 1))
        if n < 1:
            raise Refused(f"sample: num_samples must be >= 1, got {n}")
        params = req.get("sampling_params") or {}
        stop = params.get("stop")
        stop_ids: tuple[int, ...] = ()
        stop_strings: tuple[str, ...] = ()
        if isinstance(stop, str):
            stop_strings = (stop,)
        elif stop:
            if all(isinstance(x, int) for x in stop):
                stop_ids = tuple(stop)
            else:
                stop_strings = tuple(stop)
        if stop_strings and self.engine_name == "hf":
            raise Refused(f"sample: stop strings {list(stop_strings)} need the vllm engine; the hf engine stops on token ids "
                          "(renderer.get_stop_sequences() gives ids for most renderers)")
        max_tokens = params.get("max_tokens") or self.cfg.agent.max_tokens_per_turn
        seed = params.get("seed")
        rid_seqs = [f"seq-{uuid.uuid4().hex[:16]}" for _ in range(n)]
        with_prompt = bool(req.get("prompt_logprobs"))

        async def run():
            async with self._holding(base, snapshot) as engine:
                outs = await asyncio.gather(*(
                    engine.generate(prompt, SamplingParams(max_tokens=int(max_tokens), temperature=float(params.get("temperature", 1.0)),
                                                           top_p=float(params.get("top_p", 1.0)), top_k=int(params.get("top_k", -1)),
                                                           stop_token_ids=stop_ids, stop=stop_strings,
                                                           seed=None if seed is None else int(seed) + i), seq)
                    for i, seq in enumerate(rid_seqs)))
                scored = await engine.prompt_logprobs(prompt) if with_prompt else None
            for o in outs:
                if o.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"a sample ended with '{o.finish_reason}'")
            return Result(encode_sample_response([(o.token_ids, o.logprobs, o.finish_reason) for o in outs],
                                                 [math.nan, *scored] if scored is not None else None))

        return self.submit_async(run()), rid_seqs

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        for e in self.engines.values():
            with contextlib.suppress(Exception):
                if e.sender is not None:
                    e.sender.close()
                e.engine.shutdown()
        self._train.shutdown(wait=False, cancel_futures=True)
        self._load.shutdown(wait=False, cancel_futures=True)


def _prompt_tokens(model_input: dict) -> list[int]:
    tokens: list[int] = []
    for chunk in model_input.get("chunks", []):
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise Refused(f"sample: a prompt chunk of type '{kind}'; raytool serves text models (encoded_text chunks)")
        tokens += [int(t) for t in chunk["tokens"]]
    if not tokens:
        raise Refused("sample: the prompt holds no tokens")
    return tokens
