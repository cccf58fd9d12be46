"""The driver's session: connecting to Ray (a local instance does not outlive its driver), the run
directory and its log, and the checks of a run's tools before any actor starts. Shared by the
training driver (actors.drivers.pipeline), evaluation, SFT and `raytool serve`; imports no other driver module."""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from datetime import datetime
from pathlib import Path

import ray

from raytool import reaper
from raytool.config import ConfigError, RunConfig
from raytool.data.task import Task
from raytool.resolve import with_tool_sandbox_settings
from raytool.tools.registry import ToolSet, load_tool_config, row_tool_names


def default_run_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


@contextlib.contextmanager
def run_log(run_dir: Path):
    """Copy the driver's log records to RUN_DIR/run.log; an exception that ends the run leaves its
    full traceback there (remote ones included) and names the file on `exc.run_log`, so the console
    can stay at one line."""
    path = run_dir / "run.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield path
    except BaseException as exc:
        handler.stream.write("".join(traceback.format_exception(exc)))
        exc.run_log = str(path)
        raise
    finally:
        root.removeHandler(handler)
        handler.close()


def check_tools(cfg: RunConfig) -> None:
    """The tool YAML (agent.tools) must load in the driver: its classes import and build, and its
    sandbox settings agree with the run's; otherwise the first agent worker would be the one to say."""
    if not cfg.agent.tools:
        return
    try:
        with_tool_sandbox_settings(cfg)
        load_tool_config(cfg.agent.tools)
    except ConfigError as exc:
        raise ConfigError(f"config key 'agent.tools': {exc}") from None


def connect(address: str | None, log_to_driver: bool = True) -> None:
    """Attach to `address` (or RAY_ADDRESS), else start a private local Ray instance, which a reaper
    process ends if this driver is killed (raytool.reaper: Ray's agents outlive a killed driver).
    `log_to_driver`: the actors' output is copied to this console too (else it stays in Ray's
    per-actor log files only: logging.console_level)."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        reaper.start_for(os.getpid())
    if not log_to_driver:
        ray_logs_through_root()
    ray.init(address=address or "local", log_to_driver=log_to_driver)


def ray_logs_through_root() -> None:
    """Ray's driver-side logger writes to stderr itself ("Started a local Ray instance", its
    token-authentication notice): its records go through the root logger's handlers instead, to
    run.log, and to the console only as far as logging.console_level lets them (raytool.console)."""
    ray_logger = logging.getLogger("ray")
    ray_logger.handlers = []
    ray_logger.propagate = True


def dashboard_url() -> str | None:
    """The Ray dashboard of the cluster this driver is attached to, where it runs one."""
    with contextlib.suppress(Exception):
        url = ray.get_runtime_context().worker.node.address_info.get("webui_url")
        if url:
            return url if url.startswith("http") else f"http://{url}"
    return None


def actors_by_node(namespace: str) -> dict[str, dict[str, int]]:
    """Node address -> {actor class: how many} of the live actors in `namespace` (the start banner)."""
    from actors.common import live_actors

    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    placed: dict[str, dict[str, int]] = {}
    for actor in live_actors(namespace, timeout=30):
        counts = placed.setdefault(addresses.get(actor.node_id, actor.node_id or "?"), {})
        counts[actor.class_name] = counts.get(actor.class_name, 0) + 1
    return placed


def check_row_tools(toolset: ToolSet, task: Task) -> None:
    """Every prompt row's `tools` names tools of the run's tool set: one line naming the row otherwise."""
    for split, rows in (("train", task.train), ("validation", task.val)):
        for i, row in enumerate(rows):
            try:
                toolset.check_names(row_tool_names(row.tools), row.origin or f"{split} prompt row {i} (data source {row.data_source})")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
