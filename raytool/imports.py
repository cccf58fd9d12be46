"""User code named in a config: `package.module:name`, or `path/to/file.py:name` (relative to the
working directory) for a file that is not on the import path."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from raytool.config import ConfigError
from raytool.errors import one_line


def module_from_file(path: str | Path, module_name: str) -> ModuleType:
    """Execute the Python file at `path` as module `module_name` (registered in sys.modules, where
    dataclasses and pickling look it up); its own exceptions propagate."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def required_object(spec: str | None, key: str, agent_name: str):
    """The object config key `key` names, which rows with `agent_name` need; one line when it is unset."""
    if not spec:
        raise ConfigError(f"config key '{key}': rows with agent_name '{agent_name}' need it ('package.module:function' or 'path/to/file.py:function')")
    return import_object(spec, key)


def import_object(spec: str, key: str):
    """`package.module:name` or `path/to/file.py:name` -> the object, with an error naming the config key."""
    module, sep, name = spec.rpartition(":")
    if not sep or not module or not name:
        raise ConfigError(f"config key '{key}': expected 'package.module:function' or 'path/to/file.py:function', got {spec!r}")
    try:
        if module.endswith(".py"):
            if not Path(module).is_file():
                raise ConfigError(f"config key '{key}': file {module} not found (relative paths start at {Path.cwd()})")
            loaded = module_from_file(module, f"raytool_user_{Path(module).stem}")
        else:
            loaded = importlib.import_module(module)
        return getattr(loaded, name)
    except ConfigError:
        raise
    except Exception as exc:  # ImportError, AttributeError, or the module's own failure while importing
        raise ConfigError(f"config key '{key}': cannot import {spec!r} ({one_line(exc)})") from None
