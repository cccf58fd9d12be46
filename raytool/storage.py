"""Where checkpoints live: a local directory, a path every node mounts (NFS, Lustre), or an fsspec
URI (`s3://`, `gs://`, `az://`, ...: the protocol's fsspec package, s3fs say, installed on every
node). The trainer ranks and the driver read and write checkpoints through these functions only,
so one code path serves every kind of storage; `torch.distributed.checkpoint` picks its own fsspec
writer for a URI.

On several nodes each trainer rank writes its own shards: a directory only one node sees breaks
resume and export. `write_probe` / `seen_probes` let every rank check at start that it sees what
the others wrote."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from raytool.errors import RaytoolError


def filesystem(location: str | Path):
    """(fsspec filesystem, path in it) of a location; a missing fsspec backend is one line."""
    try:
        return url_to_fs(os.fspath(location))
    except (ImportError, ValueError) as exc:
        raise RaytoolError(f"checkpoint storage {location}: {exc}") from None


def checkpoints_of(checkpoint_dir: str, run_dir: str | Path) -> str:
    """Where a run's checkpoints go: RUN_DIR/checkpoints, or (trainer.checkpoint_dir set: shared
    storage or a URI) checkpoint_dir/<run name>."""
    if checkpoint_dir:
        return join(absolute(checkpoint_dir), Path(run_dir).resolve().name)
    return str((Path(run_dir) / "checkpoints").resolve())


def is_local(location: str | Path) -> bool:
    return isinstance(filesystem(location)[0], LocalFileSystem)


def absolute(location: str | Path) -> str:
    """A local path made absolute (trainer ranks run in other working directories); a URI as it is."""
    location = os.fspath(location)
    return str(Path(location).resolve()) if "://" not in location else location.rstrip("/")


def join(location: str | Path, *parts: str) -> str:
    return "/".join([os.fspath(location).rstrip("/"), *parts])


def name(location: str | Path) -> str:
    """The last part of a location (a checkpoint's `step_N`)."""
    return os.fspath(location).rstrip("/").rsplit("/", 1)[-1]


def parent(location: str | Path) -> str:
    return os.fspath(location).rstrip("/").rsplit("/", 1)[0]


def exists(location: str | Path) -> bool:
    fs, path = filesystem(location)
    return fs.exists(path)


def read_bytes(location: str | Path) -> bytes:
    fs, path = filesystem(location)
    return fs.cat_file(path)


def write_bytes(location: str | Path, data: bytes) -> None:
    fs, path = filesystem(location)
    fs.makedirs(parent(path), exist_ok=True)
    fs.pipe_file(path, data)


def open_file(location: str | Path, mode: str = "rb"):
    fs, path = filesystem(location)
    if "w" in mode:
        fs.makedirs(parent(path), exist_ok=True)
    return fs.open(path, mode)


def makedirs(location: str | Path) -> None:
    fs, path = filesystem(location)
    fs.makedirs(path, exist_ok=True)


def remove(location: str | Path) -> None:
    """Delete a file or a directory tree; nothing there is fine."""
    fs, path = filesystem(location)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def move(source: str | Path, target: str | Path) -> None:
    """Rename a directory (atomic on a local or shared file system; a copy and delete on an object store)."""
    fs, path = filesystem(source)
    if isinstance(fs, LocalFileSystem):
        os.replace(path, filesystem(target)[1])
    else:
        fs.mv(path, filesystem(target)[1], recursive=True)


def children(location: str | Path) -> list[str]:
    """The names in a directory (none when it does not exist)."""
    fs, path = filesystem(location)
    if not fs.isdir(path):
        return []
    return [name(entry) for entry in fs.ls(path, detail=False)]


def put_dir(local: str | Path, location: str | Path) -> None:
    """Copy a local directory tree to `location` (the same tree, wherever it lives)."""
    if is_local(location):
        shutil.copytree(local, filesystem(location)[1], dirs_exist_ok=True)
        return
    fs, path = filesystem(location)
    fs.put(f"{os.fspath(local).rstrip('/')}/", path, recursive=True)


def get_dir(location: str | Path, local: str | Path) -> Path:
    """A local copy of a directory tree at `location`."""
    fs, path = filesystem(location)
    fs.get(f"{path.rstrip('/')}/", f"{os.fspath(local).rstrip('/')}/", recursive=True)
    return Path(local)


def write_probe(location: str, rank: int, token: str) -> None:
    write_bytes(join(location, f"rank{rank}"), token.encode())


def seen_probes(location: str, token: str, world_size: int) -> list[int]:
    """The ranks whose probe (written with `token`) this process sees at `location`."""
    seen = []
    for rank in range(world_size):
        path = join(location, f"rank{rank}")
        try:
            if read_bytes(path) == token.encode():
                seen.append(rank)
        except FileNotFoundError:
            continue
    return seen
