"""Checkpoints of a run: the trainer group's state in RUN_DIR/checkpoints/step_N, the driver's state
next to it (driver_state.json, written last: a directory without it is not a checkpoint), and, for
an asynchronous run, the finished groups not yet trained (buffer.msgpack)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec
import ray

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
    the driver's `state` (a Struct with a `step`) last, atomically, as driver_state.json."""
    directory = (run_dir / "checkpoints" / f"step_{state.step}").resolve()
    (directory / STATE_FILE).unlink(missing_ok=True)  # re-saved in place: not a checkpoint until complete again
    trainer.save_checkpoint(str(directory))
    if buffered:
        trajectories = ray.get([g.ref for g in buffered])
        saved = [_SavedGroup(g.key, g.seq, msgspec.to_builtins(g.row), g.stats, g.submitted_version, t) for g, t in zip(buffered, trajectories)]
        (directory / BUFFER_FILE).write_bytes(msgspec.msgpack.encode(saved))
    tmp = directory / f".{STATE_FILE}.tmp"
    tmp.write_bytes(msgspec.json.encode(state))
    os.replace(tmp, directory / STATE_FILE)
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


def latest_run_dir(root: Path = Path("runs")) -> Path:
    runs = sorted((d for d in root.glob("*") if (d / "checkpoints").is_dir()), key=lambda d: d.stat().st_mtime)
    if not runs:
        raise RaytoolError(f"--resume: no run with checkpoints under {root.resolve()}; pass the run or checkpoint directory")
    return runs[-1]
