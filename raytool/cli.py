"""The `raytool` command: train (GRPO with optional SFT warm-up), sft (multi-turn SFT), eval (validation metrics),
preprocess (data sets -> prompt rows), export (checkpoint -> HF), report (a run as an HTML page), config,
sandbox serve, serve (an OpenAI-compatible API over the policy), bench NAME, chaos, rehearse (a recipe at its topology on this CPU)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from raytool.bench import BENCHES, run_bench
from raytool.chaos import KINDS as CHAOS_KINDS
from raytool.config import ConfigError, load_config, to_yaml, validate
from raytool.data.preprocess import PREPROCESSORS, preprocess
from raytool import console
from raytool.entry import entry
from raytool.errors import RaytoolError


@dataclass(frozen=True)
class Command:
    """One `raytool` command: its flags, what runs it, and what it needs first.

    `run(args)` for a command that reads no run config; `run(cfg, args, resume)` for one that does
    (`config=True`: the config is loaded, with -c, the overrides and --resume's run, before it runs).
    `guarded`: it starts something (Ray, a server, a run), so a failure or a signal ends in one line.
    `console`: the run's console (progress and summary lines) is set up for it."""

    name: str
    help: str
    flags: Callable[[argparse.ArgumentParser], None]
    run: Callable[..., int]
    config: bool = False
    guarded: bool = False
    console: bool = False


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="run config YAML (default: the embedded tiny CPU config)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=3 rollout.n=4")
    p.add_argument("-v", "--verbose", action="store_true", help="show every program's log lines on the console (logging.console_level=all)")


def _address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a new local instance)")


def _json(p: argparse.ArgumentParser, what: str = "result") -> None:
    p.add_argument("--json", action="store_true", help=f"also print the {what} as one JSON object, the last line of stdout")


def _run_flags(p: argparse.ArgumentParser, what: str = "metrics, traces and checkpoints", resume_help: str | None = None) -> None:
    _config_args(p)
    p.add_argument("--run-dir", help=f"where {what} go (default: runs/<timestamp>)")
    _address(p)
    p.add_argument("--resume", nargs="?", const="latest", metavar="PATH",
                   help=resume_help or "continue a run from its checkpoint: a checkpoints/step_N directory or a run directory (its "
                                       "latest); without PATH: the --run-dir given, else the newest run under runs/")
    p.add_argument("--overwrite", action="store_true", help="start afresh in a --run-dir that holds a run (its outputs are removed)")


def _sft_flags(p: argparse.ArgumentParser) -> None:
    _run_flags(p, "metrics and checkpoints", "continue from a checkpoint (as for train)")


def _eval_flags(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--model", required=True, help="a built-in model name, an HF directory, a raytool checkpoint or a run directory (its latest)")
    p.add_argument("--data", nargs="+", default=[], metavar="FILE", help="prompt rows (.parquet/.jsonl, raytool preprocess writes them; default: the config's validation set)")
    p.add_argument("--n", type=int, help="samples per prompt (default: eval.n)")
    _json(p, "metrics")
    _address(p)


def _preprocess_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the data set: " + ", ".join(sorted(PREPROCESSORS)))
    p.add_argument("--input", required=True, help="the data set's file (.parquet/.jsonl/.json) or HF save_to_disk folder")
    p.add_argument("--output", required=True, help="the file to write (.parquet or .jsonl)")
    p.add_argument("--limit", type=int, help="convert only the first N rows")
    p.add_argument("--system-prompt", help="the instruction that replaces the built-in tool-use prompt")
    p.add_argument("--format", choices=["hermes", "retool"], help="retool_sft/gsm8k_sft: tool calls as Hermes tool_calls (default) or ReTool <code> text")


def _export_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, help="a checkpoint directory: runs/<run>/checkpoints/step_N")
    p.add_argument("--out", required=True, help="the HF checkpoint directory to write")


def _report_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run directory (metrics.jsonl, sft_metrics.jsonl, traces.jsonl)")
    p.add_argument("--output", help="the folder for report.html and the plots' PNG files (default: RUN_DIR/report)")


def _parse_tools_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", default="-", help="the model output's text (default: stdin)")
    p.add_argument("--format", default="auto", help="agent.format: retool, hermes, a family's (raytool config --explain agent.format), or auto (default: from --model's chat template)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="with --format auto: the model whose chat template says the format (a built-in name or an HF directory)")
    p.add_argument("--tools", help="a verl-format tool YAML: its schemas type the arguments of the XML formats")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _convert_verl_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("script", help="the verl run script")
    p.add_argument("args", nargs="*", help="the script's own arguments ($@: verl overrides)")


def _plan_flags(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--nodes", type=int, help="nodes in the cluster (default: cluster.nodes, else 1)")
    p.add_argument("--gpus-per-node", type=int, help="accelerators per node (default: cluster.gpus_per_node, else this machine's)")
    p.add_argument("--gpu-memory-gb", type=float, help="memory of one accelerator, GiB (default: cluster.gpu_memory_gb, else this machine's)")
    p.add_argument("--host-memory-gb", type=float, help="host memory of one node, GiB (default: cluster.host_memory_gb, else this machine's)")
    p.add_argument("--link-gbit", type=float, help="bandwidth between nodes, Gbit/s, for the predicted weight-sync time (default: cluster.link_gbit, else 100)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object as the last line")


def _config_flags(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--reference", action="store_true", help="print the config reference (every knob: type, default, range, help, verl key) as Markdown")
    p.add_argument("--explain", metavar="KEY", help="print one knob's type, default, range, help and verl key (e.g. rollout.n)")


def _sandbox_flags(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="sandbox_command", required=True)
    serve = sub.add_parser("serve", help="serve the local sandbox over a SandboxFusion-compatible HTTP API (POST /run_code)")
    serve.add_argument("--port", type=int, default=8080, help="TCP port (default 8080, as SandboxFusion)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1; 0.0.0.0 to serve other nodes)")
    _config_args(serve)


def _serve_flags(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1; 0.0.0.0 to serve other machines)")
    _address(p)
    tinker = p.add_argument_group("the Tinker API (docs/tinker.md)")
    tinker.add_argument("--tinker", action="store_true", help="serve the Tinker API (forward_backward, optim_step, sample ...) instead of the OpenAI one")
    tinker.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                        help="a base model clients may ask for by NAME, from PATH (a built-in name or an HF directory); repeatable "
                             "(default: model.path, under its own name)")
    tinker.add_argument("--api-key", help="the key clients must send (TINKER_API_KEY, starting with tml-); default: any")
    tinker.add_argument("--checkpoints", default="runs/tinker", help="where tinker:// checkpoints and sampler weights are written (default runs/tinker)")
    tinker.add_argument("--session-ttl", type=float, default=600.0, metavar="S", help="release a session after S seconds without calls (default 600)")
    tinker.add_argument("--max-training-models", type=int, default=4, metavar="N", help="training models held at once (default 4)")


def _chaos_flags(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--kill-every", type=float, default=20.0, metavar="S", help="seconds between faults (default 20)")
    p.add_argument("--kinds", nargs="+", default=sorted(CHAOS_KINDS), choices=sorted(CHAOS_KINDS), metavar="KIND",
                   help=f"actor kinds to hit (default: all of {', '.join(sorted(CHAOS_KINDS))})")
    p.add_argument("--hang", action="store_true", help="also stop processes (SIGSTOP): the heartbeat must find them")
    p.add_argument("--seed", type=int, default=0, help="the fault schedule's seed")
    p.add_argument("--per-step", action="store_true", help="at most one fault per training step: the next comes --kill-every seconds after a step is logged")
    p.add_argument("--max-faults", type=int, default=None, metavar="N", help="stop injecting after N faults (the run goes on to its end)")
    p.add_argument("--run-dir", help="where the run goes (default: runs/<timestamp>)")
    _json(p, "report")


def _rehearse_flags(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--stages", nargs="+", choices=["sft", "grpo", "resume"], help="run only these of the recipe's stages (default: all it has)")
    p.add_argument("--workdir", help="where the shared storage, the stages' logs and the tiny model go (default: runs/rehearse-<recipe>-<time>)")
    p.add_argument("--stage-timeout", type=float, default=900.0, metavar="S", help="a stage still running after S seconds fails (default 900)")
    _json(p, "checks")


def _bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    _config_args(p)
    _json(p)
    p.add_argument("--link-mbit", type=float, help="weight-sync only: the sender and 4 receivers on simulated nodes (network "
                                                   "namespaces, as root), each behind one link of this many Mbit/s")
    p.add_argument("--trajectories", type=int, help="load only: the big round's trajectories, a multiple of 40 (default 1000); "
                                                    "the small round has a quarter (with --slow-stage: all of them, a multiple of 4, default 256)")
    p.add_argument("--slow-stage", choices=("judge", "sandbox"), help="load only: one burst of trajectories through a judge (or sandbox) "
                                                                    "ten times slower than generation, one call at a time per actor")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.flags(sub.add_parser(command.name, help=command.help))
    return parser


def _check_run_flags(args) -> None:
    """--resume with --overwrite, or a --run-dir that is a file: one line, before anything starts."""
    if getattr(args, "overwrite", False) and getattr(args, "resume", None):
        raise ConfigError("--resume continues a run and --overwrite replaces it: give one of them")
    run_dir = getattr(args, "run_dir", None)
    if run_dir and Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file, not a directory")


def _resume_hint(args) -> str:
    """What continues a stopped run (its last checkpoint, resumed exactly); "" for a command that is no run."""
    if args.command not in ("train", "sft"):
        return ""
    where = f" {args.run_dir}" if getattr(args, "run_dir", None) else ""
    return (f"; the steps after the last checkpoint are lost; continue with: raytool {args.command} --resume{where}"
            + ("" if where else "   (the latest run)"))


def _convert_verl(args) -> int:
    """The config on stdout; what was not carried, accepted or not evaluated on stderr. 1 when something was not carried."""
    from raytool.verl_convert import convert
    from raytool.verl_script import VerlScriptError

    try:
        result = convert(args.script, args.args)
    except (OSError, VerlScriptError, RaytoolError) as exc:
        print(f"raytool: {exc}", file=sys.stderr)
        return 2
    print(result.yaml, end="")
    for line in result.notes:
        print(f"raytool convert-verl: {line}", file=sys.stderr)
    for line in result.not_carried:
        print(f"raytool convert-verl: not carried: {line}", file=sys.stderr)
    return 1 if result.not_carried else 0


def _preprocess(args) -> int:
    options = {"limit": args.limit, "system_prompt": args.system_prompt, "format": args.format}
    try:
        report = preprocess(args.name, args.input, args.output, **{k: v for k, v in options.items() if v is not None})
    except RaytoolError as exc:
        print(f"raytool: {exc}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0


def _report(args) -> int:
    from raytool.report import write_report  # lazy: matplotlib

    try:
        report = write_report(args.run_dir, args.output)
    except RaytoolError as exc:
        print(f"raytool: {exc}", file=sys.stderr)
        return 2
    print(f"report: {report.html.resolve()}")
    return 0


def _eval(cfg, args, resume=None) -> int:
    from raytool.evaluation import table

    if args.n is not None:
        cfg = msgspec.structs.replace(cfg, eval=msgspec.structs.replace(cfg.eval, n=args.n))
    validate(cfg, "--n")
    metrics = entry("actors.drivers.evaluate:run_eval")(cfg, args.model, args.data, args.address)
    print(table(metrics, cfg.eval.n))
    if args.json:
        print(json.dumps({"model": args.model, "n": cfg.eval.n, **metrics}))
    return 0


def _parse_tools(args) -> int:
    from raytool.agent.families import describe, describe_table, get_parser

    try:
        fmt = args.format
        if fmt == "auto":
            from raytool.resolve import with_tool_format

            cfg = load_config(None, [f"model.path={args.model}", "agent.format=auto"])
            fmt = with_tool_format(cfg).agent.format
        get_parser(fmt)  # an unknown name: one line naming the choices
        schemas = None
        if args.tools:
            from raytool.tools.registry import load_tool_config

            schemas = {schema["function"]["name"]: schema for schema in load_tool_config(args.tools).schemas}
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    except (ConfigError, OSError, ValueError, RaytoolError) as exc:
        print(f"raytool: {exc}", file=sys.stderr)
        return 2
    found = describe(text, fmt, schemas)
    print(json.dumps(found, ensure_ascii=False) if args.json else describe_table(found))
    return 0


def _rehearse(args) -> int:
    from raytool.rehearse import RehearsalError, table, to_json

    if not args.config:
        print("raytool: rehearse needs a recipe: raytool rehearse -c examples/<recipe>.yaml", file=sys.stderr)
        return 2
    try:
        r, checks, timings = entry("actors.drivers.rehearse:rehearse")(args.config, args.overrides, args.workdir, args.stages, args.stage_timeout)
    except (RehearsalError, ConfigError, OSError) as exc:
        print(f"raytool: {exc}", file=sys.stderr)
        return 2
    print(table(r, checks, timings))
    failed = [c for c in checks if c.ok is False]
    for c in failed:
        print(f"raytool: rehearsal check failed: {c.name}: {c.detail}", file=sys.stderr)
    if args.json:
        print(json.dumps(to_json(r, checks, timings)))
    return 1 if failed else 0


def _resume_path(args) -> str | Path | None:
    """What --resume points at: a checkpoint or run directory; `latest`: --run-dir, else the newest run."""
    if getattr(args, "resume", None) != "latest":
        return getattr(args, "resume", None)
    return args.run_dir or entry("actors.drivers.checkpoint:latest_run_dir")()


def _config_path(args, resume: str | Path | None) -> str | Path | None:
    """-c, or for a resume (`resume`: _resume_path's) without it the run's own config.yaml (not the embedded default)."""
    if args.config is not None or resume is None:
        return args.config
    resume = Path(resume)
    for run_dir in (resume, resume.parent.parent):  # a run directory, or a checkpoint (its own copy, or its run's)
        if (run_dir / "config.yaml").is_file():
            logging.getLogger(__name__).info("resuming with the run's config: %s", run_dir / "config.yaml")
            return run_dir / "config.yaml"
    return None


def _plan(cfg, args, resume=None) -> int:
    from raytool.planner import PlanInputError, cluster_shape, plan, table

    flags = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "gpu_memory_gb": args.gpu_memory_gb, "host_memory_gb": args.host_memory_gb,
             "link_gbit": args.link_gbit}
    try:
        result = plan(cfg, cluster_shape(cfg, flags))
    except (FileNotFoundError, PlanInputError) as exc:
        print(f"raytool: {exc}", file=sys.stderr)
        return 2
    print(table(result))
    if args.json:
        print(json.dumps(result.to_json()))
    return 0 if not result.problems else 1


def _is_override(item: str) -> bool:
    """`section.key=value` that is not a file: argparse hands such an item to a flag with optional
    or many values (`--resume`, `--data`) that precedes it."""
    return "=" in item and "." in item.partition("=")[0] and not Path(item).exists()


def _take_back_overrides(args) -> None:
    """Overrides that `--data FILE...` or a bare `--resume` swallowed go back to the overrides."""
    taken = []
    if getattr(args, "data", None):
        taken = [item for item in args.data if _is_override(item)]
        args.data = [item for item in args.data if not _is_override(item)]
    if isinstance(getattr(args, "resume", None), str) and _is_override(args.resume):
        taken.append(args.resume)
        args.resume = "latest"
    if taken:
        args.overrides = [*args.overrides, *taken]


def _export(args) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from raytool.training.export import export_checkpoint

    try:
        print(f"exported: {export_checkpoint(args.ckpt, args.out).resolve()}")
    except RaytoolError as exc:
        print(f"raytool: {exc}", file=sys.stderr)
        return 2
    return 0


def _config(args) -> int:
    """`raytool config`: the resolved config as YAML, the reference of every knob, or one knob."""
    if args.reference or args.explain:
        from raytool.config_reference import explain, reference

        try:
            print(reference() if args.reference else explain(args.explain), end="" if args.reference else "\n")
        except ConfigError as exc:
            print(f"raytool: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        cfg, _ = _load(args)
    except (ConfigError, OSError, RaytoolError) as exc:
        print(f"raytool: {exc}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), end="")
    return 0


def _train(cfg, args, resume) -> int:
    entry("actors.drivers.pipeline:run")(cfg, args.run_dir, args.address, resume, args.overwrite)  # it ends on its summary, which names the run directory
    return 0


def _sft(cfg, args, resume) -> int:
    run_dir = entry("actors.drivers.sft:run_sft")(cfg, args.run_dir, args.address, resume, args.overwrite)
    print(f"run directory: {run_dir.resolve()}")
    return 0


def _chaos(cfg, args, resume=None) -> int:
    report = entry("actors.drivers.chaos:run_chaos")(cfg, args.run_dir, args.kinds, args.kill_every, args.hang, args.seed,
                                             per_step=args.per_step, max_faults=args.max_faults)
    print(entry("actors.drivers.chaos:table")(report))
    if args.json:
        print(json.dumps(report))
    return 0 if report["ok"] else 1


def _serve(cfg, args, resume=None) -> int:
    if args.tinker:
        if importlib.util.find_spec("tinker") is None:
            raise ConfigError("raytool serve --tinker speaks the tinker client's own schema: install the extra, pip install 'raytool[tinker]'")
        entry("raytool.tinker.server:serve_config")(cfg, args)
        return 0
    given = [flag for flag, value in (("--model", args.model), ("--api-key", args.api_key)) if value]
    if given:
        raise ConfigError(f"{', '.join(given)}: for the Tinker API (raytool serve --tinker)")
    entry("actors.drivers.serve:serve")(cfg, args.host, args.port, args.address)
    return 0


def _sandbox(cfg, args, resume=None) -> int:
    from raytool.config import sandbox_backend_options
    from raytool.sandbox.server import serve

    local = msgspec.structs.replace(cfg.sandbox, backend="local")
    serve(args.host, args.port, sandbox_backend_options(local), max_concurrency=cfg.sandbox.max_concurrency)
    return 0


def _bench(cfg, args, resume=None) -> int:
    """`raytool bench NAME`: its table, and with --json its result as the last line."""
    if args.link_mbit is not None:
        if args.name != "weight-sync":
            raise ConfigError(f"--link-mbit is for `raytool bench weight-sync`, not {args.name}")
        table, result = entry("raytool.bench.weight_sync:linked_bench")(cfg, args.link_mbit)
    elif args.slow_stage is not None or args.trajectories is not None:
        if args.name != "load":
            raise ConfigError(f"--{'slow-stage' if args.slow_stage else 'trajectories'} is for `raytool bench load`, not {args.name}")
        trajectories = [args.trajectories] if args.trajectories else []
        if args.slow_stage:
            table, result = entry("actors.benches.load:slow_stage_bench")(cfg, args.slow_stage, *trajectories)
        else:
            table, result = run_bench("load", cfg, *trajectories)
    else:
        table, result = run_bench(args.name, cfg)
    print(table)
    if args.json:
        print(json.dumps(result))
    return 0


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("train", "run SFT warm-up + GRPO on the configured task", _run_flags, _train, config=True, guarded=True, console=True),
    Command("sft", "multi-turn SFT on conversations with tool calls (sft.train_files), the ReTool cold start", _sft_flags, _sft,
            config=True, guarded=True, console=True),
    Command("eval", "validation metrics of a model: acc mean@k / maj@k / pass@k per data source, turns, tool use", _eval_flags, _eval,
            config=True, guarded=True, console=True),
    Command("preprocess", "convert a data set's local files into raytool's prompt rows (or SFT conversations)", _preprocess_flags, _preprocess),
    Command("export", "write an HF checkpoint (safetensors, config, tokenizer) from a raytool checkpoint", _export_flags, _export),
    Command("report", "write an HTML page of a run: its curves and a browser over its traced trajectories", _report_flags, _report),
    Command("parse-tools", "print the tool calls, errors and reasoning raytool reads in a model output (a file, or - for stdin)",
            _parse_tools_flags, _parse_tools),
    Command("convert-verl", "print the raytool config of a verl run script (a bash file ending in python3 -m verl.trainer.main_ppo ...), "
                            "a comment per key naming its verl override", _convert_verl_flags, _convert_verl),
    Command("plan", "predict the accelerator and host memory each role needs, and whether it fits a cluster", _plan_flags, _plan, config=True),
    Command("config", "print the resolved config as YAML; --reference: every knob's help; --explain KEY: one knob", _config_flags, _config),
    Command("sandbox", "sandbox services", _sandbox_flags, _sandbox, config=True, guarded=True),
    Command("serve", "serve the policy over an OpenAI-compatible HTTP API (rollout servers, manager, gateway)", _serve_flags, _serve,
            config=True, guarded=True),
    Command("chaos", "train while killing (and with --hang, stopping) the run's own actor processes, then check nothing was lost",
            _chaos_flags, _chaos, config=True, guarded=True, console=True),
    Command("rehearse", "run a recipe at its full topology on this CPU (simulated accelerators on several raylets, a tiny model, its "
                        "stages as ray job submits) and check placement, memory, storage and hand-offs", _rehearse_flags, _rehearse),
    Command("bench", "run a benchmark and print its table", _bench_flags, _bench, config=True, guarded=True),
)}


def _load(args) -> tuple:
    """The run config the command's flags name -> (config, what --resume points at)."""
    _check_run_flags(args)
    resume = _resume_path(args)
    cfg = load_config(_config_path(args, resume), args.overrides)
    if getattr(args, "verbose", False):
        cfg = msgspec.structs.replace(cfg, logging=msgspec.structs.replace(cfg.logging, console_level="all"))
    return cfg, resume


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    # Overrides may come after flags too (`raytool bench rollout --json rollout.n=2`), which
    # argparse leaves over: take the leftover `key=value` items as overrides, refuse the rest.
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    _take_back_overrides(args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = COMMANDS[args.command]
    if not command.config:
        return command.run(args)
    try:
        cfg, resume = _load(args)
    except (ConfigError, OSError, RaytoolError) as exc:
        print(f"raytool: {exc}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as scope:  # what a command sets up for its run (the console) ends with it
        if command.console:
            scope.enter_context(console.configured(verbose=cfg.logging.console_level == "all"))
        if not command.guarded:
            return command.run(cfg, args, resume)
        return _guarded(command, cfg, args, resume)


def _stop_ray() -> None:
    """Stop Ray's forwarding of the actors' logs, so that the reason stays the last line."""
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()


def _guarded(command: Command, cfg, args, resume) -> int:
    """Run a command that starts something (serve, bench, eval, chaos, sft, train) on the loaded
    config: its failure or a signal that stops it ends in one line."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        return command.run(cfg, args, resume)
    except (FileNotFoundError, ConfigError, RaytoolError) as exc:  # a missing model or file, a bad reward fn, a server that cannot start: one line
        where = f" (traceback in {exc.run_log})" if getattr(exc, "run_log", None) else ""
        _stop_ray()
        print(f"raytool: {exc}{where}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit) as exc:  # Ctrl-C; SIGTERM is Ray's sys.exit(15) once it started
        if isinstance(exc, SystemExit) and exc.code != signal.SIGTERM:
            raise
        _stop_ray()
        name = "SIGTERM" if isinstance(exc, SystemExit) else "SIGINT (Ctrl-C)"
        print(f"raytool: stopped by {name}{_resume_hint(args)}", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(exc, SystemExit) else signal.SIGINT)
    except Exception as exc:
        if not getattr(exc, "run_log", None):  # not from inside a run: Python's own report
            raise
        _stop_ray()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"raytool: the run failed: {type(exc).__name__}: {first} (traceback in {exc.run_log})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
