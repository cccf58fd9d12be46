"""Errors that reach people: one line naming the part, the model and the cause."""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path


class RaytoolError(RuntimeError):
    """An error whose message is complete in one line; the CLI prints it without a traceback."""


class RolloutServerError(RaytoolError):
    pass


class ActorStartError(RaytoolError):
    """An actor of the run failed to start: its role and cause; the remote traceback is its __cause__."""


def one_line(exc: BaseException, limit: int = 400) -> str:
    """`Type: message` on one line (a multi-line message joined, at most `limit` characters); a Ray
    task error is described by the exception it wraps."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    text = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def preflight_engine(model_path: str, engine: str) -> None:
    """Checks that vLLM would otherwise report only deep inside its engine-core process log."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no HF checkpoint at {model_path} (config.json missing)")
    if engine != "vllm":
        return
    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads and "hidden_size" in config else None)
    from raytool.device import detect

    if head_dim is not None and detect().kind == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in supported:
            raise ValueError(f"attention head size {head_dim} has no vLLM CPU kernel (supported: {supported})")


def describe_engine_failure(server: str, model_path: str, engine: str, exc: BaseException) -> str:
    """`rollout server rollout-server-0 (vllm, model /m): <cause>` with the cause named where it is known."""
    text = one_line(exc)
    lowered = str(exc).lower()
    if isinstance(exc, FileNotFoundError):
        cause = f"bad model path: {exc}"
    elif "out of memory" in lowered or "no available memory" in lowered or "insufficient memory" in lowered:
        cause = f"out of memory: {text}"
    elif "head size" in lowered or "head_dim" in lowered:
        cause = f"unsupported head size: {exc}"
    elif "engine core initialization failed" in lowered:
        cause = "vLLM's engine core failed to start (its traceback is in this server's log above)"
    elif "device" in lowered or "platform" in lowered:
        cause = f"unsupported device: {text}"
    else:
        cause = text
    return f"rollout server {server} ({engine}, model {model_path}): {cause}"


def start_failure(exc: BaseException) -> str:
    """The cause of an actor's failed start in one line: the exception its constructor raised
    (Ray wraps it in an ActorDiedError whose text is mostly traceback)."""
    text = str(exc)
    # Ray's creation-task error ends its traceback with the constructor's `Type: message` line.
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b:?", line):
            return line[:400]
    return one_line(exc)


def did_you_mean(name: str, choices, prefix: str = "") -> str:
    """' (did you mean 'PREFIX<closest>'?)' for the closest of `choices` to a mistyped `name`, or ''."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""
