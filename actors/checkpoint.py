"""Checkpoints of a run: the trainer group's state in RUN_DIR/checkpoints/step_N, the driver's state
next to it (driver_state.json: a directory without it is not a checkpoint), and, for an asynchronous
run, the finished groups not yet trained (buffer.msgpack). Each is written under a temporary name
and renamed into place when complete."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import msgspec
import ray

from raytool.config import RunConfig, check_resume
from raytool.errors import RaytoolError
from raytool.streaming import RolloutGroup
from raytool.types import Trajectory

log = logging.getLogger(__name__)

STATE_FILE = "driver_state.json"
BUFFER_FILE = "buffer.msgpack"


class _SavedGroup(msgspec.Struct):
    key: str
    seq: int
    row: dict
    stats: list[dict]
    submitted_version: int
    trajectories: list[Trajectory]


def save_checkpoint(trainer, run_dir: Path, state: msgspec.Struct, buffered: list[RolloutGroup] = ()) -> Path:
    """The trainer group's checkpoint in run_dir/checkpoints/step_N, `buffered` groups beside it, and
    the driver's `state` (a Struct with a `step`) last, as driver_state.json. All of it is written
    under a temporary name (.step_N.partial) and renamed into place when complete: a save that dies
    half-way leaves the checkpoints before it as they were (a re-save of step N replaces the old one
    only then)."""
    directory = (run_dir / "checkpoints" / f"step_{state.step}").resolve()
    partial = directory.with_name(f".{directory.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by a save that died
    partial.mkdir(parents=True)
    trainer.save_checkpoint(str(partial))
    if buffered:
        trajectories = ray.get([g.ref for g in buffered])
        saved = [_SavedGroup(g.key, g.seq, msgspec.to_builtins(g.row), g.stats, g.submitted_version, t) for g, t in zip(buffered, trajectories)]
        (partial / BUFFER_FILE).write_bytes(msgspec.msgpack.encode(saved))
    (partial / STATE_FILE).write_bytes(msgspec.json.encode(state))
    replaced = directory.with_name(f".{directory.name}.old")
    if directory.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(directory, replaced)
    os.replace(partial, directory)
    shutil.rmtree(replaced, ignore_errors=True)
    log.info("checkpoint: %s", directory)
    return directory


def load_buffer(checkpoint: Path, row_type: type) -> list[RolloutGroup]:
    """The finished groups a checkpoint holds (their trajectories back in the object store)."""
    path = checkpoint / BUFFER_FILE
    if not path.is_file():
        return []
    saved = msgspec.msgpack.decode(path.read_bytes(), type=list[_SavedGroup])
    return [RolloutGroup(g.key, g.seq, msgspec.convert(g.row, row_type), ray.put(g.trajectories),
                         [{**s, "version_counts": {int(v): n for v, n in s["version_counts"].items()}} for s in g.stats], g.submitted_version)
            for g in saved]


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from what a user passes to --resume: the checkpoint itself, or a run
    directory (its latest checkpoint)."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    candidates = [d for d in (path / "checkpoints").glob("step_*") if (d / STATE_FILE).is_file()]
    if not candidates:
        raise RaytoolError(f"--resume {path}: no checkpoint there (expected a checkpoints/step_N directory with {STATE_FILE}, or a run directory holding them)")
    return max(candidates, key=lambda d: int(d.name.removeprefix("step_")))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The run's newest complete checkpoint, None when it has none."""
    try:
        return find_checkpoint(run_dir)
    except RaytoolError:
        return None


def resume_checkpoint(path: str | Path, cfg: RunConfig) -> Path:
    """find_checkpoint, after checking that `cfg` keeps what the checkpoint holds (the model, the
    algorithm) against the config.yaml of the run that wrote it."""
    checkpoint = find_checkpoint(path)
    saved = checkpoint.parent.parent / "config.yaml"
    if saved.is_file():
        check_resume(saved.read_text(), cfg, str(saved))
    return checkpoint


def latest_run_dir(root: Path = Path("runs")) -> Path:
    runs = sorted((d for d in root.glob("*") if (d / "checkpoints").is_dir()), key=lambda d: d.stat().st_mtime)
    if not runs:
        raise RaytoolError(f"--resume: no run with checkpoints under {root.resolve()}; pass the run or checkpoint directory")
    return runs[-1]
