"""Shared fixtures: the tiny model and its tokenizer, and ONE Ray cluster per test session.

Markers: `integration` (starts Ray, an engine or a server process) and `gpu` (skipped without CUDA).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers.net import free_port

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Token auth for the session's cluster (the safe default of a job API). Ray reads this when it is
# first imported, so it is set here, before any test module imports ray.
os.environ["RAY_AUTH_MODE"] = "token"
# The processes the tests start (Ray workers, engine cores, `raytool` subprocesses: hundreds a run)
# cache raytool's bytecode instead of compiling it each time, where the environment turned that off.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
    _cluster_files_waiting_first(items)


# The cluster unit's files that spend much of their time waiting (engine starts, heartbeats,
# restarts, timeouts: 25-45% of the host's two cores idle while each ran alone, 2026-11-28), run
# while the other worker still has tests to fill those cores; the files that keep both cores busy
# (the asynchronous runs, the chaos run, the benches) run after it has finished, when they have the
# host to themselves. The rest keep their order, after these.
CLUSTER_FILES_FIRST = ("test_vllm_engine.py", "test_engine_crash.py", "test_eval.py", "test_faults.py", "test_end_to_end.py",
                       "test_judge_run.py", "test_gateway_actor.py", "test_sft_to_rl.py", "test_placement.py", "test_llm_manager.py",
                       "test_metrics.py")


def _cluster_files_waiting_first(items) -> None:
    """Reorder the cluster unit's tests in the places they hold (every other test keeps its place,
    so the unit still starts first), files whole (their module-scoped engines start once)."""
    slots = [i for i, item in enumerate(items) if _work_unit(item.nodeid) == "ray-cluster"]
    rank = {name: k for k, name in enumerate(CLUSTER_FILES_FIRST)}
    ordered = sorted((items[i] for i in slots), key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order holds
    for i, item in zip(slots, ordered):
        items[i] = item


# Two pytest-xdist workers (`-n 2 --dist loadgroup`, pyproject.toml), in three kinds of work unit:
# - every test of the files that use the session's Ray cluster, in one worker: one cluster in the
#   run and one set of its module-scoped engines (a test may take a module's engine by name, as
#   test_vllm_engine's parametrized ones do). Two clusters (a second unit for the other worker)
#   were tried on 2026-11-27: a worker died mid-run with its cluster, and a job's runtime_env
#   package went missing; Ray's address auto-detection (/tmp/ray/ray_current_cluster) is one
#   machine-wide file. Tried again on 2026-11-29 for three in-process files only (the faults, the
#   asynchronous runs, the chaos run) on a second cluster: the run took 2,767 s instead of
#   2,205-2,346 s (every test slower beside the other cluster: the SmolLM2 run 347 s against 146-166)
#   and test_train_as_a_ray_job's runtime_env package went missing again;
# - the other integration files (their own Ray instance, engine or server process), one at a time
#   in one unit, so that at most one of them starts beside the cluster. That unit goes first to
#   the other worker, while the cluster's unit runs the files in CLUSTER_FILES_FIRST; its timed
#   benches come after (the Tinker tests' cookbook recipes beside test_bench_load kept its judge
#   at 0.76 of its capacity, under the 0.8 it asserts: 2026-11-29, when they ran as unit tests);
# - the sandbox security tests in one unit: they find the processes their cells leave behind by
#   command line, host-wide, and the root and userns variants of a test use the same one (run at
#   once in two workers, one saw its session's process gone: 2026-11-28);
# - each other unit test alone, wherever a worker is free.
# pytest 9.2 stores a node's id where xdist 3.8's `xdist_group` marker cannot rename it, so the
# units are made here, from the files (the controller does not collect). A test on the cluster
# fails at setup, naming its file, if its unit is not the cluster unit or another worker runs it
# (`_claim_cluster_unit`), as after a worker crashed and was replaced: its cluster went with it.
@functools.cache
def _uses_cluster(path: str) -> bool:
    """A test file that names the `ray_cluster` fixture (read once: the scheduler asks per test)."""
    try:
        return (path.startswith("tests/integration/") or path.startswith("tests/test_")) and "ray_cluster" in (REPO / path).read_text()
    except OSError:
        return False


def _work_unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    if _uses_cluster(path):
        return "ray-cluster"
    if path.startswith("tests/integration/"):
        return "own-processes"
    if path.startswith("tests/sandbox_security/"):
        return "sandbox-security"
    return nodeid


@pytest.hookimpl(optionalhook=True)  # without xdist (`-p no:xdist`) the hook is unknown
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    return FileGroups(config, log)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from raytool.models import resolve_model

    return resolve_model("tiny-random")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def qwen(tokenizer):
    """A renderer of SmolLM2's tokenizer with Qwen2.5-Instruct's own chat template
    (tests/fixtures/templates), end of turn and tool-call tokens."""
    import copy

    from raytool.agent.render import ChatRenderer

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = (Path(__file__).parent / "fixtures" / "templates" / "qwen2_5_instruct.jinja").read_text()
    return ChatRenderer(tok)


@pytest.fixture(scope="session")
def logprob_tolerance() -> float:
    """Per-token |engine - trainer| log-prob of the sampled tokens after a weight sync, with this
    machine's default dtypes (`model.dtype: auto`, `trainer.compute_dtype: auto`): 1e-3 nats where
    both run in fp32 (CPUs without native bf16); 1e-2 where both run in bf16 (CPUs with it; 1.1e-3
    was measured on tiny-random with a bf16 engine and trainer, `rollout/logprob_abs_diff`)."""
    import torch

    from raytool.device import engine_dtype
    from raytool.training.trainer import compute_dtype

    engine = engine_dtype("auto", on_accelerator=False)[0]
    return 1e-3 if engine == "float32" and compute_dtype("auto", torch.device("cpu")) == torch.float32 else 1e-2


@pytest.fixture(scope="session")
def renderer(tokenizer):
    from raytool.agent.render import ChatRenderer

    return ChatRenderer(tokenizer)


def _claim_cluster_unit(config, nodeid: str, claims: Path | None = None) -> Path | None:
    """Under xdist: the worker that runs a test on the session's cluster claims the test's work
    unit for the run (a file named by the run's id); a unit another worker claimed, or one that
    is not a cluster unit, fails the test. Returns the claim this call made."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return None
    path, unit = nodeid.split("::", 1)[0], _work_unit(nodeid)
    if unit != "ray-cluster":
        raise RuntimeError(f"{path} uses ray_cluster but is not in the cluster's work unit (tests/conftest.py: _work_unit): "
                           "its worker would start a second Ray cluster beside another's")
    claims = claims or Path(tempfile.gettempdir()) / f"raytool-tests-{worker['testrunuid']}"
    claims.mkdir(exist_ok=True)
    claim = claims / unit
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        holder = claim.read_text()
        if holder != worker["workerid"]:
            raise RuntimeError(f"{path}: {worker['workerid']} runs a test of work unit {unit}, which {holder} runs: "
                               "two workers would each start a Ray cluster for one unit") from None
        return None
    os.write(fd, worker["workerid"].encode())
    os.close(fd)
    return claim


_CLAIMS: list[Path] = []


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures start a cluster
def pytest_runtest_setup(item):
    if "ray_cluster" in getattr(item, "fixturenames", ()):
        claim = _claim_cluster_unit(item.config, item.nodeid)
        if claim is not None:
            _CLAIMS.append(claim)


def pytest_sessionfinish(session):
    for claim in _CLAIMS:
        claim.unlink(missing_ok=True)
        try:
            claim.parent.rmdir()
        except OSError:  # the other worker's claim is still there
            pass


class RayCluster:
    """A head node started like a user would (`ray start --head`), with token auth on."""

    def __init__(self):
        self.port = free_port()
        self.dashboard_port = free_port()
        self.metrics_port = free_port()  # the head's Prometheus endpoint: http://127.0.0.1:{metrics_port}/metrics
        bin_dir = str(Path(sys.executable).parent)
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        ray_cli = shutil.which("ray", path=self.env["PATH"])
        if not (Path.home() / ".ray" / "auth_token").is_file() and not os.environ.get("RAY_AUTH_TOKEN"):
            # A fresh machine has no token yet, and `ray start` with token auth refuses to make one.
            subprocess.run([ray_cli, "get-auth-token", "--generate"], env=self.env, check=True, capture_output=True)
        self.proc = subprocess.Popen(
            [ray_cli, "start", "--head", "--block", f"--port={self.port}", "--num-cpus=2",
             "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
             # every port of its own, so another Ray on this machine cannot collide with it
             f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
             f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={self.metrics_port}",
             f"--ray-client-server-port={free_port()}", "--disable-usage-stats"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            self._wait_ready()
        except Exception:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float = 120.0) -> None:
        import urllib.error
        import urllib.request

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`ray start --head` exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=2):
                    return
            except urllib.error.HTTPError:  # it answered (401 without the token): it is up
                return
            except OSError:
                time.sleep(1)
        raise TimeoutError("Ray head did not come up in time")

    def stop(self) -> None:
        self.proc.terminate()  # `ray start --block` stops the head's processes when it ends
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    cluster = RayCluster()
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()


CHROMIUM = os.environ.get("RAYTOOL_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture
def browser_page():
    """A page in headless Chromium (the system's, which scripts/system_deps.sh installs, driven by
    playwright). Without Chromium the test fails, it does not skip: CI must run it. Set
    RAYTOOL_SKIP_BROWSER=1 to skip on a machine that cannot have one. Collects the page's JS errors
    in `page.js_errors`."""
    if os.environ.get("RAYTOOL_SKIP_BROWSER") == "1":
        pytest.skip("RAYTOOL_SKIP_BROWSER=1")
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: run scripts/system_deps.sh (or set RAYTOOL_SKIP_BROWSER=1 to skip this test)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.js_errors = []
            page.on("pageerror", lambda exc: page.js_errors.append(str(exc)))
            yield page
        finally:
            browser.close()


# -- leaks ------------------------------------------------------------------------------------
# A test that leaves a thread or a child process running (started in its body, not by a
# module- or session-scoped fixture) fails at teardown, naming what it left. What its own
# function-scoped fixtures stop in their teardown is not a leak: the check runs after them. A
# child's own children are its business (Ray's actors under the session's `ray start`, a sandbox's
# sessions under its fork-server). Kept for the process's life by design, so not leaks: tqdm's
# monitor thread, pyzmq's garbage-collector thread, torch inductor's compile pool, raytool's
# metrics sampler (actors.metrics, one per process), multiprocessing's resource tracker and
# forkserver, and the math-verify children of raytool.rewards.verify (one working, one spare).
# Integration tests are not held to it yet: with RAYTOOL_LEAK_REPORT=FILE their leaks are recorded
# in FILE (a survey), otherwise they are not checked.
LEAK_GRACE_S = 5.0  # a process or thread being stopped gets this long to go
LEAK_REPORT = os.environ.get("RAYTOOL_LEAK_REPORT")
_LEAK_BASE = pytest.StashKey[tuple]()
_LIFELONG_THREADS = {"TMonitor", "GarbageCollectorThread"}  # by class
_LIFELONG_THREAD_NAMES = {"raytool-metrics"}
_LIFELONG_PROCESSES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "raytool.rewards.verify import _child")


def _live_children() -> dict[int, str]:
    import psutil

    out = {}
    for p in psutil.Process().children(recursive=False):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                command = " ".join(p.cmdline())
                if not any(marker in command for marker in _LIFELONG_PROCESSES):
                    out[p.pid] = command[:160] or p.name()
        except psutil.NoSuchProcess:
            pass
    return out


def _inductor_pool_threads() -> set[int]:
    """The threads of torch inductor's compile pool (AsyncCompile.pool, cached for the process's
    life): started by the first compile that misses the on-disk cache, so by whichever test that is."""
    module = sys.modules.get("torch._inductor.async_compile")
    if module is None or module.AsyncCompile.pool.cache_info().currsize == 0:
        return set()
    return {t.ident for t in module.AsyncCompile.pool()._threads}


def _live_threads() -> dict[int, str]:
    import threading

    lifelong = _inductor_pool_threads()
    return {t.ident: t.name for t in threading.enumerate()
            if t.is_alive() and t.ident is not None and t.ident not in lifelong and type(t).__name__ not in _LIFELONG_THREADS
            and t.name not in _LIFELONG_THREAD_NAMES}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if LEAK_REPORT or item.get_closest_marker("integration") is None:
        item.stash[_LEAK_BASE] = (set(_live_threads()), set(_live_children()))  # after setup: what fixtures started is theirs
    yield


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Set up first, so torn down last: after the test's own fixtures have stopped what they started."""
    yield
    base = request.node.stash.get(_LEAK_BASE, None)
    if base is None:  # not checked, or it never ran (its setup failed, or it was skipped)
        return
    surveyed = request.node.get_closest_marker("integration") is not None
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        threads = {i: n for i, n in _live_threads().items() if i not in base[0]}
        children = {p: c for p, c in _live_children().items() if p not in base[1]}
        if not (threads or children) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not (threads or children):
        return
    what = "; ".join([f"thread {n!r}" for n in threads.values()] + [f"process {p} ({c})" for p, c in children.items()])
    if surveyed:
        with open(LEAK_REPORT, "a") as f:
            f.write(f"{request.node.nodeid}: {what}\n")
        return
    pytest.fail(f"left running after the test: {what}", pytrace=False)
