"""Checkpoints of a run: the trainer group's state in RUN_DIR/checkpoints/step_N (or, with
trainer.checkpoint_dir, a shared path or fsspec URI: DIR/<run name>/step_N), the run's config.yaml
and the driver's state next to it (driver_state.json: a directory without it is not a checkpoint),
and, for an asynchronous run, the finished groups not yet trained (buffer.msgpack). Each is written
under a temporary name and renamed into place when complete."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import msgspec
import ray

from actors.drivers.session import default_run_dir
from raytool.config import RunConfig, check_resume
from raytool import storage
from raytool.errors import RaytoolError
from raytool.streaming import GroupRefs, RolloutGroup, TrajectoryStats
from raytool.types import TrainSequence, Trajectory

log = logging.getLogger(__name__)

STATE_FILE = "driver_state.json"
RUN_DIR_FILE = "run_dir.txt"  # the run directory that wrote the checkpoint
BUFFER_FILE = "buffer.msgpack"
CONFIG_FILE = "config.yaml"


class _SavedGroup(msgspec.Struct):
    key: str
    seq: int
    row: dict
    stats: list[TrajectoryStats]
    submitted_version: int
    trajectories: list[Trajectory]


def checkpoint_root(cfg: RunConfig, run_dir: Path) -> str:
    """Where this run's checkpoints go: RUN_DIR/checkpoints, or trainer.checkpoint_dir/<run name>."""
    return storage.checkpoints_of(cfg.trainer.checkpoint_dir, run_dir)


def save_checkpoint(trainer, root: str | Path, state: msgspec.Struct, buffered: list[RolloutGroup] = (), config_yaml: str = "",
                    keep: int = 0, run_dir: Path | None = None) -> str:
    """The trainer group's checkpoint in root/step_N, `buffered` groups and the run's `config_yaml`
    beside it, and the driver's `state` (a Struct with a `step`) last, as driver_state.json. It is
    written under a temporary name (.step_N.partial) and renamed into place when complete: a save
    that dies half-way leaves the checkpoints before it as they were (a re-save of step N replaces
    the old one only then). `root`: a local or shared path, or an fsspec URI. `keep` > 0: then all
    but the newest `keep` checkpoints are deleted. `run_dir`: the run's directory, named in the
    checkpoint (RUN_DIR_FILE) so that a resume without --run-dir continues it (`resumed_run_dir`)."""
    directory = storage.join(storage.absolute(root), f"step_{state.step}")
    partial = storage.join(storage.parent(directory), f".step_{state.step}.partial")
    storage.remove(partial)  # left by a save that died
    storage.makedirs(partial)
    trainer.save_checkpoint(partial)
    if buffered:
        trajectories = ray.get([g.ref.trajectories for g in buffered])
        saved = [_SavedGroup(g.key, g.seq, msgspec.to_builtins(g.row), g.stats, g.submitted_version, t) for g, t in zip(buffered, trajectories)]
        storage.write_bytes(storage.join(partial, BUFFER_FILE), msgspec.msgpack.encode(saved))
    if config_yaml:
        storage.write_bytes(storage.join(partial, CONFIG_FILE), config_yaml.encode())
    if run_dir is not None:
        storage.write_bytes(storage.join(partial, RUN_DIR_FILE), str(Path(run_dir).resolve()).encode())
    storage.write_bytes(storage.join(partial, STATE_FILE), msgspec.json.encode(state))
    replaced = storage.join(storage.parent(directory), f".step_{state.step}.old")
    if storage.exists(directory):
        storage.remove(replaced)
        storage.move(directory, replaced)
    storage.move(partial, directory)
    storage.remove(replaced)
    log.info("checkpoint: %s", directory)
    if keep > 0:
        for step in _steps(root)[:-keep]:
            storage.remove(storage.join(root, f"step_{step}"))
    return directory


def _steps(root: str) -> list[int]:
    """The steps of the complete checkpoints under `root`, oldest first."""
    steps = sorted(int(n.removeprefix("step_")) for n in storage.children(root) if re.fullmatch(r"step_\d+", n))
    return [step for step in steps if storage.exists(storage.join(root, f"step_{step}", STATE_FILE))]


def read_state(checkpoint: str, state_type: type):
    return msgspec.json.decode(storage.read_bytes(storage.join(checkpoint, STATE_FILE)), type=state_type)


def load_buffer(checkpoint: str | Path, row_type: type) -> list[RolloutGroup]:
    """The finished groups a checkpoint holds (their trajectories back in the object store)."""
    path = storage.join(checkpoint, BUFFER_FILE)
    if not storage.exists(path):
        return []
    saved = msgspec.msgpack.decode(storage.read_bytes(path), type=list[_SavedGroup])
    return [RolloutGroup(g.key, g.seq, msgspec.convert(g.row, row_type),
                         GroupRefs(ray.put(g.trajectories), ray.put([TrainSequence.of(t) for t in g.trajectories])), g.stats, g.submitted_version)
            for g in saved]


def find_checkpoint(path: str | Path, cfg: RunConfig | None = None) -> str:
    """A checkpoint from what a user passes to --resume: the checkpoint itself (a path or URI), or
    a run directory (its latest checkpoint, where `cfg`'s trainer.checkpoint_dir puts them)."""
    if storage.exists(storage.join(path, STATE_FILE)):
        return storage.absolute(path)
    root = checkpoint_root(cfg, Path(path)) if cfg is not None else storage.absolute(Path(path) / "checkpoints")
    steps = _steps(root)
    if not steps:
        raise RaytoolError(f"--resume {path}: no checkpoint there (expected a checkpoints/step_N directory with {STATE_FILE}, "
                           f"or a run directory holding them; looked in {root})")
    return storage.join(root, f"step_{steps[-1]}")


def latest_checkpoint(run_dir: Path, cfg: RunConfig | None = None) -> str | None:
    """The run's newest complete checkpoint, None when it has none."""
    try:
        return find_checkpoint(run_dir, cfg)
    except RaytoolError:
        return None


def resume_checkpoint(path: str | Path, cfg: RunConfig) -> str:
    """find_checkpoint, after checking that `cfg` keeps what the checkpoint holds (the model, the
    algorithm) against the config of the run that wrote it (saved in the checkpoint, or the run
    directory's config.yaml)."""
    checkpoint = find_checkpoint(path, cfg)
    for saved in (storage.join(checkpoint, CONFIG_FILE), storage.join(storage.parent(storage.parent(checkpoint)), CONFIG_FILE)):
        if storage.exists(saved):
            check_resume(storage.read_bytes(saved).decode(), cfg, saved)
            break
    return checkpoint


def resumed_run_dir(checkpoint: str) -> Path:
    """The run directory a resumed run writes to when none is given: the one holding a checkpoint
    under RUN_DIR/checkpoints; else the run directory the checkpoint names (RUN_DIR_FILE), where this
    machine sees it (a shared mount: a `ray job submit` runs in a working copy the next job does not
    have); else runs/<the checkpoint's run name> (checkpoint_dir/<run name>/step_N), said in one line."""
    if storage.is_local(checkpoint) and storage.name(storage.parent(checkpoint)) == "checkpoints":
        return Path(storage.parent(storage.parent(checkpoint)))
    named = storage.join(checkpoint, RUN_DIR_FILE)
    recorded = Path(storage.read_bytes(named).decode()) if storage.exists(named) else None
    if recorded is not None and recorded.is_dir():
        return recorded
    fallback = Path("runs") / storage.name(storage.parent(checkpoint))
    if recorded is not None:
        log.warning("--resume %s: its run directory %s is not on this machine; the resumed run writes to %s (--run-dir chooses)",
                    checkpoint, recorded, fallback.resolve())
    return fallback


def where_to_run(cfg: RunConfig, run_dir: str | Path | None, resume: str | Path | None, overwrite: bool) -> tuple[str | None, Path, list[str]]:
    """A run's place -> (the checkpoint it resumes from or None, its run directory, what of an earlier
    run that directory holds and --overwrite will remove). Given no run directory, a resumed run goes
    on in its own (`resumed_run_dir`), a new one in runs/<time>."""
    checkpoint = resume_checkpoint(resume, cfg) if resume is not None else None
    if checkpoint is not None and run_dir is None:
        run_dir = resumed_run_dir(checkpoint)
    run_dir = Path(run_dir) if run_dir else default_run_dir()
    return checkpoint, run_dir, earlier_run(run_dir, overwrite) if checkpoint is None else []


# What a run writes into its directory (raytool's files only: --overwrite removes these and nothing else).
RUN_OUTPUTS = ("config.yaml", "run.log", "metrics.jsonl", "sft_metrics.jsonl", "traces.jsonl", "ledger.jsonl", "gateway.json",
               "checkpoints", "tensorboard", "report")


def earlier_run(run_dir: Path, overwrite: bool) -> list[str]:
    """What of an earlier run `run_dir` holds (RUN_OUTPUTS' names); refused in one line unless
    `overwrite`: a new run never writes over another run's config, logs or checkpoints."""
    held = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if held and not overwrite:
        raise RaytoolError(f"--run-dir {run_dir} holds a run ({', '.join(held)}): continue it with --resume, start elsewhere "
                           "with another --run-dir, or replace it with --overwrite")
    return held


def remove_earlier_run(run_dir: Path, held: list[str]) -> None:
    """--overwrite, once the new run's checks passed: the earlier run's outputs go (nothing else in the folder)."""
    import shutil

    for name in held:
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    if held:
        log.warning("--overwrite: removed the earlier run's %s from %s", ", ".join(held), run_dir)


def latest_run_dir(root: Path = Path("runs")) -> Path:
    runs = sorted((d for d in root.glob("*") if (d / "checkpoints").is_dir()), key=lambda d: d.stat().st_mtime)
    if not runs:
        raise RaytoolError(f"--resume: no run with checkpoints under {root.resolve()}; pass the run or checkpoint directory")
    return runs[-1]
