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


# Ascend collectives: HCCL's default 120 s connect timeout is shorter than a large model's load on
# a busy node; cluster.env_vars overrides it (and adds HCCL_IF_IP / HCCL_SOCKET_IFNAME for your network).
NPU_ENV = {"HCCL_CONNECT_TIMEOUT": "1800"}


def actor_options(num_cpus: float = 0.0, num_gpus: float = 0.0, accelerator: str = "GPU", env: dict | None = None, **extra) -> dict:
    """Ray options for an actor: explicit resources (Ray's default of 1 CPU starves a 2-core machine).
    `num_gpus` counts `accelerator`s: Ray's GPUs, or the custom NPU resource of Ascend nodes (Ray then
    sets ASCEND_RT_VISIBLE_DEVICES to the NPUs it assigned). `env`: more environment variables."""
    resources = dict(extra.pop("resources", None) or {})
    env_vars = {**ACTOR_ENV, **(NPU_ENV if accelerator == "NPU" and num_gpus else {}), **(env or {})}
    options = {"num_cpus": num_cpus, "runtime_env": {"env_vars": env_vars}, **extra}
    if num_gpus and accelerator == "GPU":
        options["num_gpus"] = num_gpus
    elif num_gpus:
        resources[accelerator] = resources.get(accelerator, 0.0) + num_gpus
    if resources:
        options["resources"] = resources
    return options
