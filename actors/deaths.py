"""Each rollout server's last engine death, kept in Ray's cluster-wide key-value store so that it
outlives the server's process: the restarted server compares its next death with it
(`raytool.engines.crash.repeats`), and the driver reads the one line of a server stopped for good.

Keys are the server actor's id, which stays the same across its restarts and is new for every run.
"""

from __future__ import annotations

import msgspec
from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

from raytool.engines.crash import EngineDeath

_NAMESPACE = "raytool"


def _key(actor_id: str, what: str) -> bytes:
    return f"engine-death/{actor_id}/{what}".encode()


def last_death(actor_id: str) -> EngineDeath | None:
    data = _internal_kv_get(_key(actor_id, "last"), namespace=_NAMESPACE)
    return msgspec.json.decode(data, type=EngineDeath) if data else None


def record_death(actor_id: str, death: EngineDeath) -> None:
    _internal_kv_put(_key(actor_id, "last"), msgspec.json.encode(death), overwrite=True, namespace=_NAMESPACE)


def mark_stopped(actor_id: str, line: str) -> None:
    """The server will not be restarted: `line` says why (the driver ends the run with it)."""
    _internal_kv_put(_key(actor_id, "stopped"), line.encode(), overwrite=True, namespace=_NAMESPACE)


def stopped(actor_id: str) -> str | None:
    data = _internal_kv_get(_key(actor_id, "stopped"), namespace=_NAMESPACE)
    return data.decode() if data else None
