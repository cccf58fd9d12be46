"""`raytool convert-verl SCRIPT.sh > run.yaml`: a verl run script as a raytool config.

The script's overrides (raytool.verl_script) are read as one verl command line is
(raytool.verl_keys.read); the config written holds every raytool key they set, each with a comment
naming the verl override it came from and the script's line. What raytool does anyway, what it
could not carry and what the script could not tell without running (a `$(...)`, an unset
variable) head the file as comments and go to stderr.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from raytool.config import ConfigError, apply_overrides, config_keys, from_dict, validate_rules
from raytool.verl_keys import leaves, read
from raytool.verl_script import read_verl_script


@dataclass
class Conversion:
    yaml: str  # the config, with its comments
    not_carried: list[str] = field(default_factory=list)  # one line each: refused keys, the config's own errors
    notes: list[str] = field(default_factory=list)  # accepted keys and what the script could not tell


def convert(script: str | Path, args: list[str] = (), env: dict[str, str] | None = None) -> Conversion:
    """The raytool config of verl run script `script` (its arguments `args`, the environment `env`;
    default: this process's PWD and HOME, which verl's scripts read)."""
    env = env if env is not None else {k: os.environ[k] for k in ("PWD", "HOME") if k in os.environ}
    command = read_verl_script(script, args, env)
    lines = {key.lstrip("+"): line for key, _, line in command.overrides}
    raw = apply_overrides({}, [f"{key.lstrip('+')}={value}" for key, value, _ in command.overrides])
    given = dict(leaves(raw))  # the script's values, before raytool's replace them
    sft = command.module.endswith("sft_trainer")
    reading = read(raw, set(lines), config_keys(), sft=sft)
    if sft:
        _sft_ranks(reading, command.launcher)
    sources: dict[str, list[str]] = {}
    for verl_key, target, value, note in reading.moved:
        first = verl_key.split(" + ")[0]
        where = f" (line {lines[first]})" if first in lines else ""
        said = f"{verl_key}={given[verl_key]!r}" if verl_key in given else verl_key
        sources.setdefault(target, []).append(f"{said}{where}" + (f": {note}" if note else ""))
    for key in dict(leaves(reading.raw)):
        if key in lines and key not in sources:  # the same name in both
            sources[key] = [f"{key} (line {lines[key]})"]
    not_carried = list(reading.refused)
    try:
        validate_rules(from_dict(reading.raw, str(script)), str(script))
    except ConfigError as exc:
        not_carried.append(str(exc))
    notes = [f"accepted: {a}" for a in reading.accepted] + [f"not evaluated: {u}" for u in command.unresolved]
    head = [f"# raytool config converted by `raytool convert-verl {Path(script).name}` from its `{command.module}` command "
            f"({len(command.overrides)} overrides). docs/verl.md says how each verl key is read."]
    head += _block("not carried (raytool cannot honour these, or the config they give is refused)", not_carried)
    head += _block("accepted as what raytool does, or what the script could not tell without running", notes)
    return Conversion("\n".join(head + _sections(reading.raw, sources)) + "\n", not_carried, notes)


def _sft_ranks(reading, launcher: list[str]) -> None:
    """torchrun's --nnodes x --nproc_per_node as `raytool sft`'s trainer ranks, one GPU each."""
    flags = dict(re.findall(r"--(nnodes|nproc[_-]per[_-]node)=(\d+)", " ".join(launcher)))
    nodes = int(flags.get("nnodes", 1))
    per_node = int(next((v for k, v in flags.items() if k.startswith("nproc")), 0))
    if per_node:
        for key, value in (("cluster.nodes", nodes), ("cluster.gpus_per_node", per_node), ("trainer.num_workers", nodes * per_node),
                           ("trainer.num_gpus", 1.0)):
            reading.put("torchrun --nnodes x --nproc_per_node", key, value)


def _block(title: str, lines: list[str]) -> list[str]:
    return [f"# {title}:", *(f"#   {line}" for line in lines)] if lines else []


def _sections(raw: dict, sources: dict[str, list[str]]) -> list[str]:
    """`raw` as YAML, one key a line, each with the comment naming where it came from."""
    out = []
    for section, keys in raw.items():
        if not isinstance(keys, dict):
            out.append(f"{section}: {keys!r}")
            continue
        out.append(f"{section}:")
        for key, value in keys.items():
            text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("...").strip()
            why = "; ".join(sources.get(f"{section}.{key}", []))
            out.append(f"  {key}: {text}" + (f"  # {why}" if why else ""))
    return out
