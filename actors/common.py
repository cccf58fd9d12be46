"""What every actor is started with: quiet library logging, offline hub, and sized resources."""

from __future__ import annotations

import os

ACTOR_ENV = {
    "HF_HUB_OFFLINE": "1",  # weights never come from a hub at run time
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # no weight-loading bars from every actor in the driver log
    "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),  # no per-sync INFO lines from vLLM
    # vLLM logs to stdout by default, and Ray forwards actors' stdout to the driver's: the engine's
    # shutdown warnings would land after a command's last-line JSON (`raytool eval/bench --json`).
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}


def actor_options(num_cpus: float = 0.0, num_gpus: float = 0.0, **extra) -> dict:
    """Ray options for an actor: explicit resources (Ray's default of 1 CPU starves a 2-core machine)."""
    options = {"num_cpus": num_cpus, "runtime_env": {"env_vars": dict(ACTOR_ENV)}, **extra}
    if num_gpus:
        options["num_gpus"] = num_gpus
    return options
