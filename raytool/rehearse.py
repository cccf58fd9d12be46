"""`raytool rehearse`: what a CPU rehearsal of a reference recipe runs and checks (no Ray here).

A rehearsal runs the recipe at its cluster's topology on this machine (several raylets, each
declaring the recipe's node accelerators), with the recipe's own YAML and only what cannot run here
swapped: a tiny random model of the same family, the HF rollout engine, two steps per stage, tiny
batches, the shipped fixtures (tests/fixtures/sources) in the real data sets' schemas, a local
SandboxFusion-compatible server, and a directory playing the shared mount. This module decides
those swaps (each an `Override` the user sees), how far the topology is scaled down where this
host's cores or memory forbid, the stages' command lines, and judges the measurements the Ray
layer (actors/drivers/rehearse.py) brings back.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from raytool import storage
from raytool.config import RunConfig
from raytool.errors import RaytoolError
from raytool.placement import agent_workers

REPO = Path(__file__).resolve().parents[1]
SOURCES = REPO / "tests" / "fixtures" / "sources"
TEMPLATES = REPO / "tests" / "fixtures" / "templates"
GiB = 1024**3

# A recipe's data file (by name) -> the preprocessor and the fixture in the source data set's schema
# that stands in for it (the recipes' headers name the same preprocessors).
FIXTURES = {
    "dapo_math_17k.parquet": ("dapo_math_17k", "dapo_math_17k.parquet"),
    "aime_2024.parquet": ("aime_2024", "aime_2024.jsonl"),
    "aime_2025.parquet": ("aime_2025", "aime_2025.parquet"),
    "retool_sft.parquet": ("retool_sft", "retool_sft.parquet"),
    "gsm8k_train.parquet": ("gsm8k", "gsm8k.jsonl"),
    "gsm8k_test.parquet": ("gsm8k", "gsm8k_hf"),
    "gsm8k_sft.parquet": ("gsm8k_sft", "gsm8k.jsonl"),
}
SFT_PREPROCESSORS = ("retool_sft", "gsm8k_sft")
STEPS = 2  # optimizer steps per stage
# What one process costs this host (measured on the 2-core development machine): a trainer rank or
# an HF-engine server imports torch and transformers (0.4 GiB, raytool.planner's PROCESS_BASE) in a
# Ray worker (~0.15 GiB more) and spends a few core-seconds starting; a light actor ~0.15 GiB.
HEAVY_PROCESS_GIB = 0.6
LIGHT_PROCESS_GIB = 0.15
HEAVY_PER_CORE = 10  # trainer ranks + rollout servers per core before the stages crawl
RAYLETS_PER_CORE = 2  # simulated nodes per core (a raylet, its dashboard agent and runtime-env agent each)
MEMORY_SHARE = 0.6  # of the memory available now, what the rehearsal's processes may take
CPUS_PER_NODE = 96  # Ray CPUs each simulated node declares (the recipes name accelerators only; a p4d has 96)
PEAK_TOLERANCE = 1.2  # measured trainer peak / the plan's host figure still within (the planner's own tests allow 20%)


class RehearsalError(RaytoolError):
    """A recipe that cannot be rehearsed: one line naming the key or file it lacks."""


@dataclass(frozen=True)
class Override:
    key: str  # the dotted config key (or what else was swapped)
    value: str  # as the stage's command line gives it
    recipe: str  # what the recipe had
    why: str

    def arg(self) -> str:
        return f"{self.key}={self.value}"


@dataclass(frozen=True)
class Node:
    name: str
    head: bool
    accelerators: dict[str, float]  # {"GPU": 8} / {"NPU": 16}; {} for a CPU-only head
    cpus: float = CPUS_PER_NODE


@dataclass(frozen=True)
class Host:
    cores: int
    memory_gib: float  # available now

    @classmethod
    def this_machine(cls) -> "Host":
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
        except OSError:
            pass
        return cls(len(os.sched_getaffinity(0)), available / GiB)


@dataclass(frozen=True)
class Stage:
    name: str  # sft, grpo, resume
    command: str  # raytool's subcommand
    args: list[str]  # after it: -c, overrides, --run-dir / --resume
    run_dir: str

    def entrypoint(self) -> str:
        import shlex

        return shlex.join(["raytool", self.command, *self.args])


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: does not apply to this recipe, or its stage did not run
    detail: str


@dataclass
class Rehearsal:
    recipe: str  # the path as given
    config_arg: str  # the path the jobs pass to -c (relative to the job's working copy where the recipe is in the repo)
    family: str
    tiny_model: str  # where the tiny model goes (built by build_tiny_model)
    template: str  # its chat template's fixture
    nodes: list[Node]
    scaled: list[str]  # one line per scale-down: what, from, to, why
    overrides: list[Override]  # for every stage
    shared: Path
    sandbox: str  # how the recipe's sandbox was stood in for
    stages: list[Stage] = field(default_factory=list)
    data: dict[str, tuple[str, str]] = field(default_factory=dict)  # shared file -> (preprocessor, fixture)
    cannot: list[str] = field(default_factory=list)  # what a CPU cannot rehearse for this recipe
    sft_steps: int = 0
    sft_copies: int = 1  # the SFT fixture's conversations repeated this many times (every rank gets one)
    extra: list[str] = field(default_factory=list)  # the user's own overrides of the recipe
    export: str = ""  # the HF export the GRPO stage reads (SFT stage's), "" when the recipe has no SFT stage
    rl_checkpoints: str = ""  # where the GRPO stage's checkpoints go

    @property
    def accelerator(self) -> str:
        return next((k for n in self.nodes for k in n.accelerators), "GPU")


def recipe_keys(path: str | Path) -> dict:
    """The recipe's own keys (nested dicts, as written), for telling what it sets from defaults."""
    try:
        return yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise RehearsalError(f"cannot rehearse {path}: {exc}") from None


def _given(raw: dict, key: str) -> bool:
    node = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return node is not None


def check_rehearsable(path: str | Path, raw: dict, cfg: RunConfig) -> None:
    """One line naming what the recipe lacks for a rehearsal: its cluster (cluster.nodes,
    cluster.gpus_per_node), a model raytool knows the family of, data files the fixtures stand in for."""
    for key in ("cluster.nodes", "cluster.gpus_per_node", "model.path"):
        if not _given(raw, key):
            raise RehearsalError(f"cannot rehearse {path}: config key '{key}' is missing (a rehearsal runs the recipe at the "
                                 f"cluster it names: cluster.nodes x cluster.gpus_per_node, as `raytool plan` reads them)")
    if not cfg.cluster.gpus_per_node:
        raise RehearsalError(f"cannot rehearse {path}: config key 'cluster.gpus_per_node' is 0: a CPU-only recipe runs as it is "
                             f"(`raytool train -c {path}`); a rehearsal simulates accelerators")
    try:
        model_family(cfg.model.path)
    except RehearsalError as exc:
        raise RehearsalError(f"cannot rehearse {path}: {exc}") from None
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files), ("sft.train_files", cfg.sft.train_files),
                       ("sft.val_files", cfg.sft.val_files)):
        for f in files:
            if Path(f).name not in FIXTURES:
                raise RehearsalError(f"cannot rehearse {path}: config key '{key}' names {f}, for which no fixture stands in "
                                     f"(known: {', '.join(sorted(FIXTURES))})")


def model_family(model_path: str) -> str:
    """qwen2, qwen3, qwen3_moe or llama: the checkpoint's model_type where this machine holds it, else from its name."""
    import json

    config = Path(model_path) / "config.json"
    if config.is_file():
        kind = json.loads(config.read_text()).get("model_type", "")
    else:
        name = Path(model_path).name.lower()
        kind = ("qwen3_moe" if "qwen3" in name and "-a" in name.split("qwen3")[-1] else "qwen3" if "qwen3" in name
                else "qwen2" if "qwen2" in name else "llama" if "llama" in name or "smollm" in name else "")
    if kind not in ("qwen2", "qwen3", "qwen3_moe", "llama"):
        raise RehearsalError(f"config key 'model.path' is {model_path}: raytool has no tiny model of its family "
                             f"({kind or 'unknown'}; it has qwen2, qwen3, qwen3_moe and llama)")
    return kind


def chat_template(model_path: str, family: str) -> str:
    """The fixture of the model's own chat template (tests/fixtures/templates), "" for the built-in models' own."""
    name = Path(model_path).name.lower()
    if family == "qwen2":
        return "qwen2_5_instruct.jinja"
    if family in ("qwen3", "qwen3_moe"):
        return "qwen3_instruct_2507.jinja" if "2507" in name else "qwen3.jinja"
    return ""


def scale(count: int, factor: float) -> int:
    return max(1, math.floor(count * factor))


def topology(cfg: RunConfig, host: Host) -> tuple[list[Node], list[str], dict[str, int]]:
    """The simulated nodes, the scale-down lines, and the role counts that fit this host:
    trainer.num_workers and rollout.num_servers as the recipe has them, scaled only where the
    nodes had to be fewer (the accelerators shrink with them) or the heavy processes (each a torch
    import) would not fit this host's cores or memory. A one-node recipe gets a CPU-only head
    beside its node (at least two raylets: the jobs' drivers run on the head, as on a cluster
    whose head has no accelerators)."""
    c, t, r = cfg.cluster, cfg.trainer, cfg.rollout
    acc = c.accelerator
    scaled = []
    nodes = min(c.nodes, max(1, RAYLETS_PER_CORE * host.cores - (c.nodes == 1)))
    counts = {"trainer.num_workers": t.num_workers, "rollout.num_servers": r.num_servers}
    if nodes < c.nodes:
        scaled.append(f"nodes: {c.nodes} -> {nodes} ({nodes / c.nodes:.2f}x): {RAYLETS_PER_CORE} raylets per core on {host.cores} cores")
        counts = {k: scale(v, nodes / c.nodes) for k, v in counts.items()}
    light = cfg.reward.num_workers + agent_workers(cfg) + cfg.sandbox.num_pools + 1
    memory_cap = int((MEMORY_SHARE * host.memory_gib - light * LIGHT_PROCESS_GIB - (nodes + 1) * 0.4) / HEAVY_PROCESS_GIB)
    cap = max(2, min(HEAVY_PER_CORE * host.cores, memory_cap))
    heavy = sum(counts.values())
    if heavy > cap:
        factor = cap / heavy
        why = (f"{cap} trainer ranks + rollout servers fit this host ({HEAVY_PER_CORE} per core on {host.cores} cores, "
               f"{HEAVY_PROCESS_GIB} GiB each of {MEMORY_SHARE:.0%} of {host.memory_gib:.1f} GiB available)")
        for key, v in counts.items():
            counts[key] = scale(v, factor)
            if counts[key] != v:
                scaled.append(f"{key}: {v} -> {counts[key]} ({counts[key] / v:.2f}x): {why}")
    layout = [Node(f"node-{i}", i == 0 and nodes > 1, {acc: float(c.gpus_per_node)}) for i in range(nodes)]
    if nodes == 1:
        layout = [Node("head", True, {}), Node("node-0", False, {acc: float(c.gpus_per_node)})]
    return layout, scaled, counts


def stage_sizes(cfg: RunConfig, counts: dict[str, int]) -> list[Override]:
    """Two steps per stage, tiny batches that still give every data-parallel trainer rank a
    sequence, short generations, no validation sampling beyond one prompt."""
    workers = counts["trainer.num_workers"]
    dp = workers // cfg.trainer.sequence_parallel_size
    t, r, a, e = cfg.trainer, cfg.rollout, cfg.agent, cfg.eval
    n = 2
    prompts = max(2, math.ceil(dp / n))
    wanted = [
        ("trainer.total_steps", STEPS, t.total_steps, f"{STEPS} GRPO steps"),
        ("trainer.save_every", 1, t.save_every, "a checkpoint after step 1, for the resume stage"),
        ("data.prompts_per_step", prompts, cfg.data.prompts_per_step, f"tiny batches: {prompts} x {n} trajectories, one or more per data-parallel rank"),
        ("rollout.n", n, r.n, "tiny batches (a GRPO group needs 2)"),
        ("algorithm.mini_batches", 1, cfg.algorithm.mini_batches, "one optimizer step per GRPO step"),
        ("algorithm.max_sampling_rounds", 1, cfg.algorithm.max_sampling_rounds, "dynamic sampling: one round (a random model's groups often score alike)"),
        ("rollout.max_tokens_per_turn", 16, r.max_tokens_per_turn, "short generations: the model is random"),
        ("agent.max_response_tokens", 48, a.max_response_tokens, "short generations: the model is random"),
        ("rollout.max_model_len", 1024, r.max_model_len, "within the tiny model's 2048 positions"),
        ("eval.n", 1, e.n, "validation: one sample"),
        ("eval.max_prompts", 1, e.max_prompts, "validation: one prompt"),
        ("eval.every", 0, e.every, "validation only before and after training"),
        ("cluster.torch_threads", 1, cfg.cluster.torch_threads, "every engine and trainer process shares this host's cores"),
        ("rollout.seed", r.seed if r.seed is not None else 0, r.seed, "seeded sampling: the resumed step must repeat the original exactly"),
    ]
    if cfg.reward.overlong_buffer_tokens:
        wanted.append(("reward.overlong_buffer_tokens", 16, cfg.reward.overlong_buffer_tokens, "DAPO's overlong shaping within the short responses"))
    if t.sft_warmup_steps:
        wanted.append(("trainer.sft_warmup_steps", STEPS, t.sft_warmup_steps, f"{STEPS} SFT warm-up steps"))
    if t.cpu_offload:
        wanted.append(("trainer.cpu_offload", "false", "true", "FSDP2's offload needs an accelerator; on a CPU the states already live in host memory"))
    return [Override(k, _text(v), _text(old), why) for k, v, old, why in wanted if _text(v) != _text(old)]


def _text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _files_override(key: str, files: list[str], shared: Path, data: dict) -> Override | None:
    if not files:
        return None
    moved = []
    for f in files:
        target = shared / "data" / Path(f).name
        data[str(target)] = FIXTURES[Path(f).name]
        moved.append(str(target))
    return Override(key, "[" + ",".join(moved) + "]", "[" + ",".join(files) + "]",
                    "the shipped fixture in the data set's schema, preprocessed onto the shared storage")


def plan_rehearsal(recipe: str | Path, cfg: RunConfig, raw: dict, host: Host, shared: Path, sandbox_url: str,
                   sft_conversations: int = 0, extra: list[str] = ()) -> Rehearsal:
    """Every swap and scale-down of a rehearsal of `recipe` (its loaded config `cfg`, its own keys
    `raw`), its stages and what a CPU cannot rehearse of it. `shared`: the directory playing the
    shared mount; `sandbox_url`: the local SandboxFusion-compatible server's /run_code;
    `sft_conversations`: how many usable conversations the SFT fixtures hold (count_conversations);
    `extra`: the user's own overrides of the recipe, passed on to every stage before the rehearsal's."""
    check_rehearsable(recipe, raw, cfg)
    family = model_family(cfg.model.path)
    template = chat_template(cfg.model.path, family)
    nodes, scaled, counts = topology(cfg, host)
    recipe_path = Path(recipe).resolve()
    config_arg = str(recipe_path.relative_to(REPO)) if recipe_path.is_relative_to(REPO) else str(recipe_path)
    tiny = str(shared / "models" / f"tiny-{family}-{Path(cfg.model.path).name}")
    overrides = [Override("model.path", tiny, cfg.model.path, f"a tiny random {family} model with {Path(cfg.model.path).name}'s chat template")]
    if cfg.rollout.engine != "hf":
        overrides.append(Override("rollout.engine", "hf", cfg.rollout.engine, "vLLM cannot shard or start many servers on a CPU in time; the HF engine runs here"))
    for key, v in counts.items():
        old = cfg.trainer.num_workers if key.startswith("trainer") else cfg.rollout.num_servers
        if v != old:
            overrides.append(Override(key, str(v), str(old), "scaled down: see above"))
    data: dict[str, tuple[str, str]] = {}
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files),
                       ("sft.train_files", cfg.sft.train_files), ("sft.val_files", cfg.sft.val_files)):
        moved = _files_override(key, files, shared, data)
        if moved:
            overrides.append(moved)
    overrides += stage_sizes(cfg, counts)
    copies = 1
    if cfg.sft.train_files:
        copies, more = sft_sizes(cfg, sft_conversations, counts["trainer.num_workers"] // cfg.trainer.sequence_parallel_size)
        overrides += more
    sandbox, more = sandbox_overrides(cfg, shared, sandbox_url)
    overrides += more
    if cfg.trainer.checkpoint_dir:
        overrides.append(Override("trainer.checkpoint_dir", str(shared / "checkpoints"), cfg.trainer.checkpoint_dir,
                                  "the directory playing the shared mount"))
    r = Rehearsal(str(recipe), config_arg, family, tiny, template, nodes, scaled, overrides, shared, sandbox, data=data, sft_copies=copies,
                  extra=list(extra))
    r.stages = stages(cfg, r)
    r.cannot = cannot_rehearse(cfg)
    return r


def sandbox_overrides(cfg: RunConfig, shared: Path, url: str) -> tuple[str, list[Override]]:
    """The recipe's sandbox service, started locally: a SandboxFusion URL points at the local
    server; an E2B (or AGS) tool cannot reach its cloud from here, so its tool YAML is copied with
    the e2b_* keys swapped for the local server's URL (the schema and limits kept)."""
    from raytool.resolve import with_tool_sandbox_settings

    backend = with_tool_sandbox_settings(cfg).sandbox.backend
    if backend == "sandbox_fusion":
        return (f"SandboxFusion: `raytool sandbox serve` on {url}",
                [Override("sandbox.fusion_url", url, cfg.sandbox.fusion_url, "the recipe's SandboxFusion service, started locally")])
    if backend == "e2b":
        tools = shared / "tools" / Path(cfg.agent.tools).name
        write_local_tool_yaml(cfg.agent.tools, tools, url)
        return (f"E2B ({cfg.sandbox.e2b_domain or 'e2b.dev'}) is a cloud service this machine cannot reach: its tool YAML runs on "
                f"`raytool sandbox serve` on {url} instead",
                [Override("agent.tools", str(tools), cfg.agent.tools, "E2B's cloud is out of reach: the same tool on the local SandboxFusion-compatible server")])
    return f"{backend}: the pools' own backend", []


def write_local_tool_yaml(source: str, target: Path, url: str) -> None:
    """A copy of a verl tool YAML whose E2B code tools run on the SandboxFusion server at `url`."""
    doc = yaml.safe_load(Path(source).read_text())
    for tool in doc.get("tools", []):
        config = tool.get("config") or {}
        if any(k.startswith("e2b_") for k in config):
            tool["config"] = {"type": config.get("type", "native"), "sandbox_fusion_url": url,
                              **{k: config[k] for k in ("default_timeout", "default_language") if k in config}}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(doc, sort_keys=False))


def stages(cfg: RunConfig, r: Rehearsal) -> list[Stage]:
    """The recipe's stages as its header runs them: `raytool sft` (when SFT is a stage of its own)
    into the shared run directory, `raytool train` from its HF export, then a resume of the GRPO
    run from its step-1 checkpoint (as a user would: `--resume CHECKPOINT`, no --run-dir)."""
    base = ["-c", r.config_arg, *r.extra, *[o.arg() for o in r.overrides]]
    runs = r.shared / "runs"
    name = Path(r.recipe).stem
    out = []
    if cfg.sft.train_files and not cfg.trainer.sft_warmup_steps:
        sft_dir = runs / f"{name}-sft"
        r.sft_steps = STEPS
        out.append(Stage("sft", "sft", [*base, "--run-dir", str(sft_dir)], str(sft_dir)))
        r.export = str(Path(storage.checkpoints_of(shared_checkpoints(cfg, r), sft_dir)) / f"step_{STEPS}" / "hf")
        base = [a for a in base if not a.startswith("model.path=")] + [f"model.path={r.export}"]  # the later stages start from the SFT export
    rl_dir = runs / f"{name}-rl"
    out.append(Stage("grpo", "train", [*base, "--run-dir", str(rl_dir)], str(rl_dir)))
    r.rl_checkpoints = storage.checkpoints_of(shared_checkpoints(cfg, r), rl_dir)
    out.append(Stage("resume", "train", [*base, "--resume", str(Path(r.rl_checkpoints) / "step_1")], str(rl_dir)))
    return out


def sft_sizes(cfg: RunConfig, conversations: int, dp: int) -> tuple[int, list[Override]]:
    """`raytool sft` (or the in-run warm-up) in STEPS steps of one epoch, every data-parallel rank
    given a conversation: -> (how many times the fixture's `conversations` are repeated, the
    overrides). The validation split (sft.val_fraction) is taken out first, as raytool does."""
    s = cfg.sft
    copies = 1
    while _sft_train(copies * conversations, s) < STEPS * dp:
        copies += 1
    batch = math.ceil(_sft_train(copies * conversations, s) / STEPS)
    wanted = [("sft.epochs", 1, s.epochs, f"{STEPS} SFT steps: one epoch"),
              ("sft.batch_size", batch, s.batch_size, f"{STEPS} SFT steps of the fixture's conversations" + (f" (repeated {copies}x: one or more per data-parallel rank)" if copies > 1 else "")),
              ("sft.save_every", 0, s.save_every, "one checkpoint, at the end"), ("sft.warmup_steps", 0, s.warmup_steps, f"{STEPS} steps")]
    return copies, [Override(k, _text(v), _text(old), why) for k, v, old, why in wanted if _text(v) != _text(old)]


def _sft_train(n: int, s) -> int:
    """Training conversations left of `n` after the validation split (raytool.data.conversations.split_validation)."""
    if s.val_files or s.val_fraction <= 0:
        return n
    return n - max(round(n * s.val_fraction), 1)


def shared_checkpoints(cfg: RunConfig, r: Rehearsal) -> str:
    """The trainer.checkpoint_dir the stages run with: the recipe's, moved onto the shared directory ("": none)."""
    return str(r.shared / "checkpoints") if cfg.trainer.checkpoint_dir else ""


def cannot_rehearse(cfg: RunConfig) -> list[str]:
    """What of this recipe a CPU rehearsal does not exercise, one line each."""
    r, t, c = cfg.rollout, cfg.trainer, cfg.cluster
    acc, npu = c.accelerator, c.accelerator == "NPU"
    out = []
    if r.engine == "vllm":
        out.append(f"the rollout engine: {'vllm-ascend' if npu else 'vLLM'} (engine start, KV cache in gpu_memory_utilization "
                   f"{r.gpu_memory_utilization}, {'CUDA graphs, ' if not r.enforce_eager and not npu else ''}sleep/wake, weight loads); "
                   "the rehearsal's servers ran the HF engine")
    if r.tensor_parallel_size > 1:
        out.append(f"vLLM tensor parallelism (TP {r.tensor_parallel_size}: one server's model over {r.tensor_parallel_size} {acc}s): "
                   f"each rehearsal server reserved {r.num_gpus:g} {acc}s but ran on one process")
    if t.num_workers > 1:
        out.append(f"{'HCCL' if npu else 'NCCL'} collectives: FSDP2 ran over gloo on this CPU")
    if npu:
        out.append("NPU kernels (torch_npu, vllm-ascend's), ASCEND_RT_VISIBLE_DEVICES binding to real devices, HCCL settings")
    out.append(f"{acc} memory: `raytool plan`'s accelerator figures are not measured here (host memory is)")
    if t.cpu_offload:
        out.append("FSDP2 CPU offload (it needs an accelerator: the rehearsal trained without it)")
    if c.nodes > 1:
        out.append("cross-node networking: every raylet shares this host (NIC settings such as GLOO_SOCKET_IFNAME / "
                   f"{'HCCL' if npu else 'NCCL'}_SOCKET_IFNAME, bandwidth, the shared mount's latency)")
    from raytool.resolve import with_tool_sandbox_settings

    if with_tool_sandbox_settings(cfg).sandbox.backend == "e2b":
        out.append("the real E2B / AGS service (API key, quotas, latency, sandbox lifetime): cells went to a local server")
    out.append("the real model's size (load and checkpoint times, weight-sync bytes) and its behaviour: a random 2-layer model "
               "calls no tool, so the sandbox sees no cell")
    return out


# --------------------------------------------------------------------------- data and model


def count_conversations(cfg: RunConfig, scratch: Path) -> int:
    """The usable conversations the fixtures behind sft.train_files hold (preprocessed into `scratch`)."""
    from raytool.data.preprocess import preprocess

    total = 0
    for f in cfg.sft.train_files:
        if Path(f).name in FIXTURES:
            name, fixture = FIXTURES[Path(f).name]
            total += preprocess(name, SOURCES / fixture, scratch / Path(f).name).converted
    return total


def prepare_data(r: Rehearsal) -> None:
    """Preprocess each fixture onto the shared storage, as the recipe's header does with the real
    data sets; the SFT conversations repeated r.sft_copies times (enough for every rank)."""
    from raytool.data.preprocess import preprocess

    for target, (name, fixture) in r.data.items():
        preprocess(name, SOURCES / fixture, target)
        if r.sft_copies > 1 and name in SFT_PREPROCESSORS:
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pq.read_table(target)
            pq.write_table(pa.concat_tables([table] * r.sft_copies), target)


def build_tiny_model(r: Rehearsal, model_path: str) -> str:
    """A tiny random model of the recipe model's family (2 layers, hidden 128) with SmolLM2's
    tokenizer and the model's own chat template, written where the rehearsal's model.path points
    (a qwen3_moe recipe gets raytool's tiny-random-moe, a llama one tiny-random)."""
    import json

    from raytool.models import TINY_RANDOM, TINY_RANDOM_MOE, resolve_model

    out = Path(r.tiny_model)
    if (out / "config.json").is_file():
        return str(out)
    base = Path(resolve_model(TINY_RANDOM_MOE if r.family == "qwen3_moe" else TINY_RANDOM))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if r.family in ("qwen2", "qwen3"):
        import torch
        import transformers

        base_config = json.loads((base / "config.json").read_text())
        shape = {k: base_config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                              "num_key_value_heads", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")}
        config_class, model_class = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[r.family]
        config = getattr(transformers, config_class)(**shape, tie_word_embeddings=_tied(model_path))
        torch.manual_seed(0)
        getattr(transformers, model_class)(config).save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(base / name, tmp / name)
    else:
        shutil.copytree(base, tmp)
    if r.template:
        (tmp / "chat_template.jinja").write_text((TEMPLATES / r.template).read_text())
    tmp.rename(out)
    return str(out)


def _tied(model_path: str) -> bool:
    from raytool.planner import KNOWN

    return bool(KNOWN.get(Path(model_path).name, {}).get("tied", True))


# --------------------------------------------------------------------------- checks


ROLES = {"trainer": "trainer worker", "rollout-server": "rollout server", "sandbox-pool": "sandbox pool", "reward-worker": "reward worker",
         "agent-worker": "agent worker", "llm-manager": "llm manager"}


def role_of(actor_name: str) -> str | None:
    base = actor_name.rsplit("-", 1)[0] if actor_name[-1:].isdigit() else actor_name
    return ROLES.get(base)


@dataclass
class Seen:
    """One actor as the rehearsal's sampler saw it during a stage."""

    name: str
    node: str  # the simulated node's name
    pid: int
    resources: dict[str, float]
    peak_bytes: int = 0  # VmHWM of its process, last read


def check_placement(stage: str, seen: list[Seen], expected: dict[str, int], nodes: list[Node], accelerators: dict[str, float],
                    acc: str) -> Check:
    """Every role's actors placed (as many as the config asks), each accelerator role's actors
    only on nodes that declare the accelerator and holding what the plan counts for it, and no
    node holding more accelerators than it declares."""
    by_role: dict[str, list[Seen]] = {}
    for s in seen:
        role = role_of(s.name)
        if role:
            by_role.setdefault(role, []).append(s)
    problems = []
    for role, count in expected.items():
        got = len(by_role.get(role, []))
        if got != count:
            problems.append(f"{got} of {count} {role}s placed")
    declared = {n.name: n.accelerators.get(acc, 0.0) for n in nodes}

    def asks(s: Seen) -> float:  # in a placement group Ray names the resource <acc>_group_[<bundle>_]<group id>
        return max((v for k, v in s.resources.items() if k == acc or k.startswith(f"{acc}_group_")), default=0.0)

    held: dict[str, float] = {}
    for role, actors in by_role.items():
        total = sum(asks(s) for s in actors)
        if role in accelerators and abs(total - accelerators[role]) > 1e-6:
            problems.append(f"the {role}s hold {total:g} {acc}s, the plan counts {accelerators[role]:g}")
        for s in actors:
            held[s.node] = held.get(s.node, 0.0) + asks(s)
            if asks(s) and not declared.get(s.node):
                problems.append(f"{s.name} holds {acc}s on {s.node}, which declares none")
    problems += [f"{node} holds {v:g} {acc}s of its {declared.get(node, 0):g}" for node, v in held.items() if v > declared.get(node, 0) + 1e-6]
    layout = "; ".join(f"{node}: {count_roles(seen, node)}" for node in sorted({s.node for s in seen}))
    if problems:
        return Check(f"placement ({stage})", False, "; ".join(problems) + f" [{layout}]")
    return Check(f"placement ({stage})", True, layout)


def count_roles(seen: list[Seen], node: str) -> str:
    counts: dict[str, int] = {}
    for s in seen:
        if s.node == node:
            role = role_of(s.name) or s.name
            counts[role] = counts.get(role, 0) + 1
    return ", ".join(f"{n} {role}{'s' if n > 1 else ''}" for role, n in sorted(counts.items()))


def check_trainer_memory(stage: str, seen: list[Seen], planned: float, loading: float) -> Check:
    """Each trainer rank's host peak (VmHWM) within the plan's host figure for it (rank 0 plus
    `loading`, the larger of its read of the checkpoint and its write of the export), PEAK_TOLERANCE allowed."""
    ranks = sorted((s for s in seen if role_of(s.name) == "trainer worker"), key=lambda s: int(s.name.rsplit("-", 1)[1]))
    if not ranks or not any(s.peak_bytes for s in ranks):
        return Check(f"trainer host memory ({stage})", False, "no trainer rank's memory could be read")
    worst = max(ranks, key=lambda s: s.peak_bytes / (planned + (loading if s.name == "trainer-0" else 0)))
    over = [s for s in ranks if s.peak_bytes > PEAK_TOLERANCE * (planned + (loading if s.name == "trainer-0" else 0))]
    ratio = worst.peak_bytes / (planned + (loading if worst.name == "trainer-0" else 0))
    detail = (f"{len(ranks)} ranks, peaks {min(s.peak_bytes for s in ranks) / GiB:.2f}-{max(s.peak_bytes for s in ranks) / GiB:.2f} GiB; "
              f"plan {planned / GiB:.2f} GiB (+{loading / GiB:.2f} rank 0 loading or exporting); worst {worst.name} at {ratio:.2f}x")
    if over:
        return Check(f"trainer host memory ({stage})", False, detail + f"; over {PEAK_TOLERANCE:g}x: {', '.join(s.name for s in over)}")
    return Check(f"trainer host memory ({stage})", True, detail)


def check_checkpoints(stage: str, root: Path, steps: list[int], shared: Path, export: bool) -> Check:
    """The stage's checkpoints complete (driver_state.json written last) under the shared directory, its HF export too."""
    name = f"checkpoints ({stage})"
    if not root.resolve().is_relative_to(shared.resolve()):
        return Check(name, False, f"checkpoints go to {root}, outside the shared directory {shared}")
    missing = [f"step_{n}" for n in steps if not (root / f"step_{n}" / "driver_state.json").is_file()]
    if export and not (root / f"step_{steps[-1]}" / "hf" / "config.json").is_file():
        missing.append(f"step_{steps[-1]}/hf (the HF export)")
    if missing:
        return Check(name, False, f"missing under {root}: {', '.join(missing)}")
    return Check(name, True, f"{', '.join(f'step_{n}' for n in steps)}{' + HF export' if export else ''} under {root}")


def latest_step(root: Path) -> int | None:
    """The newest complete checkpoint's step under `root` (driver_state.json is written last)."""
    steps = [int(d.name.removeprefix("step_")) for d in root.glob("step_*") if d.name.removeprefix("step_").isdigit() and (d / "driver_state.json").is_file()]
    return max(steps, default=None)


def use_export(r: Rehearsal, step: int) -> None:
    """The later stages start from the SFT stage's export of `step` (what it really wrote: a user
    reads step_<N> off the shared storage the same way)."""
    export = str(Path(r.export).parent.parent / f"step_{step}" / "hf")
    for stage in r.stages:
        stage.args[:] = [f"model.path={export}" if a == f"model.path={r.export}" else a for a in stage.args]
    r.export = export


def check_sft_rows(logs: str) -> Check:
    """Every SFT conversation rendered by the model's chat template: a skipped one is data the recipe loses."""
    skipped = re.findall(r"skipped (\S+) row (\d+) \(0-based\): (.*?)(?: \(|$)", logs, flags=re.M)
    if skipped:
        reasons = sorted({why for _, _, why in skipped})
        return Check("sft conversations (sft)", False, f"{len(skipped)} rows skipped by `raytool sft`: {'; '.join(reasons)[:300]}")
    return Check("sft conversations (sft)", True, "every conversation rendered")


def check_export_read(r: Rehearsal, run_dir: Path, ok: bool) -> Check:
    """The GRPO stage started from the SFT stage's HF export on the shared storage (its config.yaml says so, and it ran)."""
    if not r.export:
        return Check("export read back (grpo)", None, "the recipe has no SFT stage of its own (in-run warm-up or none)")
    config = run_dir / "config.yaml"
    used = (yaml.safe_load(config.read_text()) or {}).get("model", {}).get("path") if config.is_file() else None
    if used != r.export:
        return Check("export read back (grpo)", False, f"the GRPO run's model.path is {used!r}, not the SFT export {r.export}")
    return Check("export read back (grpo)", ok, f"model.path {r.export}" + ("" if ok else " (but the stage failed)"))


# a metric that measures time or this host's speed, not what the run computed
_TIMING = re.compile(r"(^timing(_s)?/|_s$|per_s|_seconds|idle_ratio|latency|tokens_per_s)")


def check_resume(run_dir: Path, before: list[dict], after: list[dict], logs: str, ok: bool) -> Check:
    """The resumed run continued the shared run: its log says it resumed at step 1, the run's
    metrics.jsonl holds step 1 as it was and step 2 once, and the redone step 2 computed what the
    original step 2 did (every metric but timings)."""
    name = "resume exact (resume)"
    said = re.search(r"resumed from (\S+) at step (\d+)", logs)
    if not ok or said is None:
        return Check(name, False, "the resumed run did not say it resumed" + ("" if ok else " (the stage failed)"))
    before = [m for m in before if m.get("step", 0) >= 1]  # step 0: validation before training
    after = [m for m in after if m.get("step", 0) >= 1]
    steps = [m.get("step") for m in after]
    if after == before or steps != [1, STEPS]:
        where = re.findall(r"run directory: (\S+)", logs)
        return Check(name, False, f"{run_dir}/metrics.jsonl has steps {steps} after the resume (before: {[m.get('step') for m in before]}); "
                                  f"the resumed run wrote to {where[-1] if where else 'another directory'}")
    original, redone = before[-1], after[-1]
    differ = sorted(k for k in set(original) | set(redone) if not _TIMING.search(k) and not _same(original.get(k), redone.get(k)))
    if before[0] != after[0] or differ:
        return Check(name, False, f"resumed at step {said.group(2)}; step 2 differs from the original in {', '.join(differ[:8]) or 'step 1'}")
    return Check(name, True, f"resumed from step {said.group(2)}; step 2 repeated exactly ({len(original)} metrics, timings aside); "
                             f"policy_version {redone.get('policy_version')}")


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))
    return a == b


def table(r: Rehearsal, checks: list[Check], timings: dict[str, float]) -> str:
    """The rehearsal's report: topology and scale-downs, every override, the checks, what a CPU cannot rehearse."""
    lines = [f"rehearsal of {r.recipe} ({r.family} family)",
             "nodes: " + "; ".join(f"{n.name}{' (head)' if n.head else ''}: " + (", ".join(f"{v:g} {k}" for k, v in n.accelerators.items()) or "no accelerators")
                                   for n in r.nodes)]
    lines += [f"scaled down: {s}" for s in r.scaled] or ["scaled down: nothing (the recipe's nodes, ranks and servers as they are)"]
    lines += [f"sandbox: {r.sandbox}", f"shared storage: {r.shared}", "", "overrides (the recipe's value -> the rehearsal's, why):"]
    width = max(len(o.key) for o in r.overrides)
    lines += [f"  {o.key:<{width}}  {o.recipe} -> {o.value}  ({o.why})" for o in r.overrides]
    lines += ["", "stages (ray job submit entrypoints):"] + [f"  {s.name}: {s.entrypoint()}" for s in r.stages]
    lines += ["", f"{'check':<34} {'result':<6} detail"]
    lines += [f"{c.name:<34} {'ok' if c.ok else 'n/a' if c.ok is None else 'FAIL':<6} {c.detail}" for c in checks]
    lines += ["", "timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())]
    lines += ["", "not rehearsed on a CPU:"] + [f"  - {c}" for c in r.cannot]
    return "\n".join(lines)


def to_json(r: Rehearsal, checks: list[Check], timings: dict[str, float]) -> dict:
    return {"recipe": r.recipe, "ok": all(c.ok is not False for c in checks), "checks": [asdict(c) for c in checks],
            "nodes": [asdict(n) for n in r.nodes], "scaled": r.scaled, "overrides": [asdict(o) for o in r.overrides],
            "stages": {s.name: s.entrypoint() for s in r.stages}, "timings_s": timings, "not_rehearsed": r.cannot}
