"""The config resolved once: every `auto` and every setting derived from another, decided in one
place before any actor starts, into the one RunConfig every actor receives and config.yaml records.

`resolve(cfg)` checks that the algorithms it names are registered, then applies, in order:
- the sandbox settings a verl tool YAML implies (`agent.tools`: an E2B domain, a SandboxFusion URL),
  where the run config left the default;
- `agent.num_workers: auto` -> as many agent workers as keep every rollout server full;
- `model.dtype: auto` -> the dtype the rollout engine runs on its device (raytool.device.engine_dtype);
- `algorithm.rollout_correction.rollout_is: auto` -> `token` in asynchronous mode, null (off) in
  synchronous mode;
- `agent.format: auto` -> the tool-call format the model's chat template writes;
- `trainer.weight_sync_backend: auto` -> `collective` where the trainer runs on accelerators and this
  torch build has their collective backend (NCCL, HCCL), `zmq` otherwise; `collective` named by the
  user is refused in one line where the backend is missing;
- user code named by a file path relative to the working directory (`agent.openai_agent`,
  `agent.langgraph_graph`, `agent.environment`: `path/to/file.py:name`) -> its absolute path, which
  the actors (started in other directories) can import.
It is idempotent: a resolved config comes back unchanged. What depends on the trainer's own device
and memory (`trainer.micro_batch_tokens`, `activation_checkpointing`, `compile`, `kernels`) is
decided by `with_trainer_autos` once the trainer's rank 0 sees its device: the trainer group asks
it there, every rank receives its decision, and the driver records it in config.yaml.
"""

from __future__ import annotations

import logging

import msgspec

from raytool.config import ConfigError, RunConfig, SandboxConfig, validate_sandbox_lifetime
from raytool.device import engine_dtype
from raytool.placement import agent_workers

log = logging.getLogger(__name__)


def resolve(cfg: RunConfig) -> RunConfig:
    """`cfg` with its autos and derived settings decided (see the module's docstring)."""
    check_algorithms(cfg)
    cfg = with_weight_sync_backend(with_tool_sandbox_settings(cfg))
    return with_user_code_paths(with_tool_format(with_rollout_correction(with_engine_dtype(with_agent_workers(cfg)))))


def with_weight_sync_backend(cfg: RunConfig) -> RunConfig:
    """trainer.weight_sync_backend auto decided; `collective` checked against this torch build."""
    from raytool.weightsync.collective import BACKENDS, auto_backend, missing_backend, weights_device

    t, device = cfg.trainer, weights_device(cfg)
    backend = t.weight_sync_backend
    if backend == "auto":
        why = missing_backend(device) if device != "cpu" else "CPU weights"
        backend = auto_backend(device, why is None)
        log.info("trainer.weight_sync_backend auto: %s (the trainer's weights are on %s%s)", backend, device, f": {why}" if why else "")
    elif backend == "collective" and (why := missing_backend(device)):
        raise ConfigError(f"config key 'trainer.weight_sync_backend': collective syncs {device} weights with {BACKENDS[device]}, but {why}; "
                          "set it to zmq")
    return cfg if backend == t.weight_sync_backend else msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(t, weight_sync_backend=backend))


# verl's estimators that need what raytool does not train or keep -> what to use
_NO_ESTIMATOR = {"gae": "GAE needs a critic (a value model), which raytool does not train",
                 "reinforce_plus_plus": "REINFORCE++ needs a per-token KL in the reward, which raytool does not compute",
                 "remax": "ReMax needs a greedy baseline rollout per prompt, which raytool does not sample"}


def check_algorithms(cfg: RunConfig) -> None:
    """algorithm.adv_estimator and algorithm.policy_loss name registered functions (raytool.algos:
    built in, or registered by the user's code before the run starts); checked before anything
    starts, since the trainer looks them up only after the first rollout."""
    from raytool.algos import ADV_ESTIMATORS, POLICY_LOSSES

    a = cfg.algorithm
    for key, name, registry in (("adv_estimator", a.adv_estimator, ADV_ESTIMATORS), ("policy_loss", a.policy_loss, POLICY_LOSSES)):
        if name not in registry:
            why = f"{_NO_ESTIMATOR[name]}; " if key == "adv_estimator" and name in _NO_ESTIMATOR else ""
            raise ConfigError(f"config key 'algorithm.{key}': {why}unknown {registry.what} '{name}'; registered: {', '.join(sorted(registry))}")


def with_epochs(cfg: RunConfig, prompts: int) -> RunConfig:
    """trainer.total_epochs (verl's) as trainer.total_steps, once the `prompts` usable training
    prompts are known: whole batches of data.prompts_per_step per pass, as verl's loader (it drops
    the last partial batch). A config without it comes back unchanged."""
    from raytool.verl_keys import steps_of_epochs

    t = cfg.trainer
    if t.total_epochs is None:
        return cfg
    steps = steps_of_epochs(t.total_epochs, prompts, cfg.data.prompts_per_step)
    log.info("trainer.total_epochs=%d: %d GRPO steps (%d training prompts, %d a step)", t.total_epochs, steps, prompts, cfg.data.prompts_per_step)
    return msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(t, total_steps=steps, total_epochs=None))


def with_agent_workers(cfg: RunConfig) -> RunConfig:
    """agent.num_workers auto decided (`agent_workers`); a set value that leaves the servers part idle is said once."""
    a, r = cfg.agent, cfg.rollout
    workers = agent_workers(cfg)
    if a.num_workers == "auto":
        log.info("agent.num_workers auto: %d (%d rollout servers x %d sequences, %d trajectories a worker)", workers, r.num_servers,
                 r.max_batch_size, a.max_concurrent_trajectories)
        return msgspec.structs.replace(cfg, agent=msgspec.structs.replace(a, num_workers=workers))
    if workers * a.max_concurrent_trajectories < r.num_servers * r.max_batch_size:
        log.warning("agent.num_workers=%d x agent.max_concurrent_trajectories=%d keeps at most %d trajectories in flight, where %d rollout "
                    "servers run %d sequences at once: raise one of them (or set agent.num_workers=auto)", workers,
                    a.max_concurrent_trajectories, workers * a.max_concurrent_trajectories, r.num_servers, r.num_servers * r.max_batch_size)
    return cfg


def with_user_code_paths(cfg: RunConfig) -> RunConfig:
    """`path/to/file.py:name` specs of the agent's user code with the file's absolute path."""
    from pathlib import Path

    changes = {}
    for key in ("openai_agent", "langgraph_graph", "environment"):
        spec = getattr(cfg.agent, key)
        module, sep, name = (spec or "").rpartition(":")
        if sep and module.endswith(".py") and not Path(module).is_absolute() and Path(module).is_file():
            changes[key] = f"{Path(module).resolve()}:{name}"
    return msgspec.structs.replace(cfg, agent=msgspec.structs.replace(cfg.agent, **changes)) if changes else cfg


def with_tool_format(cfg: RunConfig) -> RunConfig:
    """agent.format auto: the tool-call format the model's chat template writes (raytool.agent.families.detect)."""
    if cfg.agent.format != "auto":
        return cfg
    from raytool.agent.families import detect
    from raytool.models import load_tokenizer, resolve_model

    template = load_tokenizer(resolve_model(cfg.model.path)).chat_template
    found = detect(template if isinstance(template, str) else None)
    if found is None:
        from raytool.agent.families import FORMATS
        from raytool.agent.parsers import PARSERS

        names = sorted([*PARSERS, *FORMATS])
        raise ConfigError(f"config key 'agent.format': auto found no tool-call format in the chat template of {cfg.model.path}; "
                          f"set one of {names}")
    log.info("agent.format auto: %s (from the chat template of %s)", found, cfg.model.path)
    return msgspec.structs.replace(cfg, agent=msgspec.structs.replace(cfg.agent, format=found))


def with_rollout_correction(cfg: RunConfig) -> RunConfig:
    """rollout_is auto: truncated token-level importance weights in asynchronous mode (the engine's
    tokens come from older weights than the trainer's), none in synchronous mode."""
    c = cfg.algorithm.rollout_correction
    if c.rollout_is != "auto":
        return cfg
    decided = "token" if cfg.async_.max_staleness > 0 else None
    c = msgspec.structs.replace(c, rollout_is=decided)
    return msgspec.structs.replace(cfg, algorithm=msgspec.structs.replace(cfg.algorithm, rollout_correction=c))


def with_tool_sandbox_settings(cfg: RunConfig) -> RunConfig:
    """Apply the sandbox settings a verl tool YAML (agent.tools) implies, e.g. an E2B domain or a
    SandboxFusion URL, where the run config left the default. Where the run config sets one too
    (`sandbox.fusion_url=...` on the command line: the service of this cluster), the config's
    value is used and a line says so; a different backend is an error naming both."""
    if not cfg.agent.tools:
        return cfg
    from raytool.tools.registry import tool_config_sandbox_overrides

    wanted = tool_config_sandbox_overrides(cfg.agent.tools)
    defaults, current = SandboxConfig(), cfg.sandbox
    changes = {}
    for key, value in wanted.items():
        have = getattr(current, key)
        if have != getattr(defaults, key) and have != value:
            if key == "backend":
                raise ConfigError(f"config key 'sandbox.backend' is {have!r} but the tools of {cfg.agent.tools} run on {value!r}; keep one of them")
            log.info("sandbox.%s: %r from the run config, not %r from %s", key, have, value, cfg.agent.tools)
            continue
        changes[key] = value
    cfg = msgspec.structs.replace(cfg, sandbox=msgspec.structs.replace(current, **changes))
    validate_sandbox_lifetime(cfg, cfg.agent.tools)  # the tool file may have set the sandbox's lifetime
    return cfg


def with_engine_dtype(cfg: RunConfig) -> RunConfig:
    """`cfg` with model.dtype resolved (auto: see `raytool.device.engine_dtype`), so that the engines
    and the weight syncs that feed them agree; a dtype the rollout device cannot run stops here."""
    try:
        dtype, why = engine_dtype(cfg.model.dtype, on_accelerator=cfg.rollout.num_gpus > 0, engine=cfg.rollout.engine)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if dtype != cfg.model.dtype:
        log.info("model.dtype %s: %s (%s)", cfg.model.dtype, dtype, why)
    return msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, dtype=dtype))


def with_trainer_autos(cfg: RunConfig, model_path: str, on_accelerator: bool, accelerator_bytes: float, log_notes: bool = True) -> RunConfig:
    """trainer.micro_batch_tokens, trainer.activation_checkpointing, trainer.compile and trainer.kernels
    "auto" decided for the trainer's device and its memory, as `raytool plan` decides them
    (raytool.planner.resolve_auto), each decision said once."""
    t = cfg.trainer
    if "auto" not in (t.micro_batch_tokens, t.activation_checkpointing, t.compile, t.kernels):
        return cfg
    from raytool.planner import architecture, resolve_auto

    cfg, notes = resolve_auto(cfg, architecture(model_path), on_accelerator, accelerator_bytes)
    for note in notes if log_notes else []:
        log.info("%s", note)
    return cfg
