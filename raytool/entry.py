"""The one way `raytool/` reaches the Ray layer (`actors/`): an entry named "module:function",
imported when first called, so that the CLI's start, `raytool config` or `raytool bench router`
never import Ray or torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def entry(spec: str) -> Callable:
    """The function `spec` ("package.module:function") names, its module imported now."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"an entry is 'package.module:function', not {spec!r}")
    return getattr(importlib.import_module(module), name)
