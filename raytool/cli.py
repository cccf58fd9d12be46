"""The `raytool` command: train (GRPO with optional SFT warm-up), sft (multi-turn SFT), eval (validation metrics),
preprocess (data sets -> prompt rows), export (checkpoint -> HF), report (a run as an HTML page), config,
sandbox serve, serve (an OpenAI-compatible API over the policy), bench NAME, chaos, rehearse (a recipe at its topology on this CPU)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

import msgspec

from raytool.bench import BENCHES
from raytool.chaos import KINDS as CHAOS_KINDS
from raytool.config import ConfigError, load_config, to_yaml, validate
from raytool.data.preprocess import PREPROCESSORS, preprocess
from raytool import console
from raytool.errors import RaytoolError


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="run config YAML (default: the embedded tiny CPU config)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=3 rollout.n=4")
    p.add_argument("-v", "--verbose", action="store_true", help="show every program's log lines on the console (logging.console_level=all)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run SFT warm-up + GRPO on the configured task")
    _config_args(train)
    train.add_argument("--run-dir", help="where metrics, traces and checkpoints go (default: runs/<timestamp>)")
    train.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a new local instance)")
    train.add_argument("--resume", nargs="?", const="latest", metavar="PATH",
                       help="continue a run from its checkpoint: a checkpoints/step_N directory or a run directory (its latest); "
                            "without PATH: the --run-dir given, else the newest run under runs/")
    train.add_argument("--overwrite", action="store_true", help="start afresh in a --run-dir that holds a run (its outputs are removed)")
    sft = sub.add_parser("sft", help="multi-turn SFT on conversations with tool calls (sft.train_files), the ReTool cold start")
    _config_args(sft)
    sft.add_argument("--run-dir", help="where metrics and checkpoints go (default: runs/<timestamp>)")
    sft.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a new local instance)")
    sft.add_argument("--resume", nargs="?", const="latest", metavar="PATH", help="continue from a checkpoint (as for train)")
    sft.add_argument("--overwrite", action="store_true", help="start afresh in a --run-dir that holds a run (its outputs are removed)")
    evaluate = sub.add_parser("eval", help="validation metrics of a model: acc mean@k / maj@k / pass@k per data source, turns, tool use")
    _config_args(evaluate)
    evaluate.add_argument("--model", required=True, help="a built-in model name, an HF directory, a raytool checkpoint or a run directory (its latest)")
    evaluate.add_argument("--data", nargs="+", default=[], metavar="FILE", help="prompt rows (.parquet/.jsonl, raytool preprocess writes them; default: the config's validation set)")
    evaluate.add_argument("--n", type=int, help="samples per prompt (default: eval.n)")
    evaluate.add_argument("--json", action="store_true", help="also print the metrics as one JSON object, the last line of stdout")
    evaluate.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a new local instance)")
    prep = sub.add_parser("preprocess", help="convert a data set's local files into raytool's prompt rows (or SFT conversations)")
    prep.add_argument("name", help="the data set: " + ", ".join(sorted(PREPROCESSORS)))
    prep.add_argument("--input", required=True, help="the data set's file (.parquet/.jsonl/.json) or HF save_to_disk folder")
    prep.add_argument("--output", required=True, help="the file to write (.parquet or .jsonl)")
    prep.add_argument("--limit", type=int, help="convert only the first N rows")
    prep.add_argument("--system-prompt", help="the instruction that replaces the built-in tool-use prompt")
    prep.add_argument("--format", choices=["hermes", "retool"], help="retool_sft/gsm8k_sft: tool calls as Hermes tool_calls (default) or ReTool <code> text")
    export = sub.add_parser("export", help="write an HF checkpoint (safetensors, config, tokenizer) from a raytool checkpoint")
    export.add_argument("--ckpt", required=True, help="a checkpoint directory: runs/<run>/checkpoints/step_N")
    export.add_argument("--out", required=True, help="the HF checkpoint directory to write")
    report = sub.add_parser("report", help="write an HTML page of a run: its curves and a browser over its traced trajectories")
    report.add_argument("run_dir", help="the run directory (metrics.jsonl, sft_metrics.jsonl, traces.jsonl)")
    report.add_argument("--output", help="the folder for report.html and the plots' PNG files (default: RUN_DIR/report)")
    parse_tools = sub.add_parser("parse-tools", help="print the tool calls, errors and reasoning raytool reads in a model output (a file, or - for stdin)")
    parse_tools.add_argument("file", nargs="?", default="-", help="the model output's text (default: stdin)")
    parse_tools.add_argument("--format", default="auto", help="agent.format: retool, hermes, a family's (raytool config --explain agent.format), or auto (default: from --model's chat template)")
    parse_tools.add_argument("--model", default="smollm2-135m-instruct", help="with --format auto: the model whose chat template says the format (a built-in name or an HF directory)")
    parse_tools.add_argument("--tools", help="a verl-format tool YAML: its schemas type the arguments of the XML formats")
    parse_tools.add_argument("--json", action="store_true", help="print the result as one JSON object")
    convert = sub.add_parser("convert-verl", help="print the raytool config of a verl run script (a bash file ending in python3 -m "
                                                  "verl.trainer.main_ppo ...), a comment per key naming its verl override")
    convert.add_argument("script", help="the verl run script")
    convert.add_argument("args", nargs="*", help="the script's own arguments ($@: verl overrides)")
    plan = sub.add_parser("plan", help="predict the accelerator and host memory each role needs, and whether it fits a cluster")
    _config_args(plan)
    plan.add_argument("--nodes", type=int, help="nodes in the cluster (default: cluster.nodes, else 1)")
    plan.add_argument("--gpus-per-node", type=int, help="accelerators per node (default: cluster.gpus_per_node, else this machine's)")
    plan.add_argument("--gpu-memory-gb", type=float, help="memory of one accelerator, GiB (default: cluster.gpu_memory_gb, else this machine's)")
    plan.add_argument("--host-memory-gb", type=float, help="host memory of one node, GiB (default: cluster.host_memory_gb, else this machine's)")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object as the last line")
    show = sub.add_parser("config", help="print the resolved config as YAML; --reference: every knob's help; --explain KEY: one knob")
    _config_args(show)
    show.add_argument("--reference", action="store_true", help="print the config reference (every knob: type, default, range, help, verl key) as Markdown")
    show.add_argument("--explain", metavar="KEY", help="print one knob's type, default, range, help and verl key (e.g. rollout.n)")
    sandbox = sub.add_parser("sandbox", help="sandbox services")
    sandbox_sub = sandbox.add_subparsers(dest="sandbox_command", required=True)
    serve = sandbox_sub.add_parser("serve", help="serve the local sandbox over a SandboxFusion-compatible HTTP API (POST /run_code)")
    serve.add_argument("--port", type=int, default=8080, help="TCP port (default 8080, as SandboxFusion)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1; 0.0.0.0 to serve other nodes)")
    _config_args(serve)
    gateway = sub.add_parser("serve", help="serve the policy over an OpenAI-compatible HTTP API (rollout servers, manager, gateway)")
    _config_args(gateway)
    gateway.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    gateway.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1; 0.0.0.0 to serve other machines)")
    gateway.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a new local instance)")
    chaos = sub.add_parser("chaos", help="train while killing (and with --hang, stopping) the run's own actor processes, then check nothing was lost")
    _config_args(chaos)
    chaos.add_argument("--kill-every", type=float, default=20.0, metavar="S", help="seconds between faults (default 20)")
    chaos.add_argument("--kinds", nargs="+", default=sorted(CHAOS_KINDS), choices=sorted(CHAOS_KINDS), metavar="KIND",
                       help=f"actor kinds to hit (default: all of {', '.join(sorted(CHAOS_KINDS))})")
    chaos.add_argument("--hang", action="store_true", help="also stop processes (SIGSTOP): the heartbeat must find them")
    chaos.add_argument("--seed", type=int, default=0, help="the fault schedule's seed")
    chaos.add_argument("--per-step", action="store_true", help="at most one fault per training step: the next comes --kill-every seconds after a step is logged")
    chaos.add_argument("--max-faults", type=int, default=None, metavar="N", help="stop injecting after N faults (the run goes on to its end)")
    chaos.add_argument("--run-dir", help="where the run goes (default: runs/<timestamp>)")
    chaos.add_argument("--json", action="store_true", help="also print the report as one JSON object, the last line of stdout")
    rehearse = sub.add_parser("rehearse", help="run a recipe at its full topology on this CPU (simulated accelerators on several raylets, a tiny "
                                                "model, its stages as ray job submits) and check placement, memory, storage and hand-offs")
    _config_args(rehearse)
    rehearse.add_argument("--stages", nargs="+", choices=["sft", "grpo", "resume"], help="run only these of the recipe's stages (default: all it has)")
    rehearse.add_argument("--workdir", help="where the shared storage, the stages' logs and the tiny model go (default: runs/rehearse-<recipe>-<time>)")
    rehearse.add_argument("--stage-timeout", type=float, default=900.0, metavar="S", help="a stage still running after S seconds fails (default 900)")
    rehearse.add_argument("--json", action="store_true", help="also print the checks as one JSON object, the last line of stdout")
    bench = sub.add_parser("bench", help="run a benchmark and print its table")
    bench.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    _config_args(bench)
    bench.add_argument("--json", action="store_true", help="also print the result as one JSON object, the last line of stdout")
    bench.add_argument("--link-mbit", type=float, help="weight-sync only: the sender and 4 receivers on simulated nodes (network "
                                                        "namespaces, as root), each behind one link of this many Mbit/s")
    bench.add_argument("--trajectories", type=int, help="load only: the big round's trajectories, a multiple of 40 (default 1000); "
                                                         "the small round has a quarter (with --slow-stage: all of them, a multiple of 4, default 256)")
    bench.add_argument("--slow-stage", choices=("judge", "sandbox"), help="load only: one burst of trajectories through a judge (or sandbox) "
                                                                         "ten times slower than generation, one call at a time per actor")
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


def _eval(cfg, args) -> int:
    from actors.evaluate import run_eval  # lazy: the Ray layer
    from raytool.evaluation import table

    if args.n is not None:
        cfg = msgspec.structs.replace(cfg, eval=msgspec.structs.replace(cfg.eval, n=args.n))
    validate(cfg, "--n")
    metrics = run_eval(cfg, args.model, args.data, args.address)
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
    from actors.rehearse import rehearse  # lazy: the Ray layer

    try:
        r, checks, timings = rehearse(args.config, args.overrides, args.workdir, args.stages, args.stage_timeout)
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
    from actors.checkpoint import latest_run_dir  # lazy: the Ray layer

    return args.run_dir or latest_run_dir()


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


def _plan(cfg, args) -> int:
    from raytool.planner import PlanInputError, cluster_shape, plan, table

    flags = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "gpu_memory_gb": args.gpu_memory_gb, "host_memory_gb": args.host_memory_gb}
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


def main(argv: list[str] | None = None) -> int:
    with contextlib.ExitStack() as scope:  # what a command sets up for its run (the console) ends with it
        return _main(argv, scope)


def _main(argv: list[str] | None, scope: contextlib.ExitStack) -> int:
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "preprocess":
        return _preprocess(args)
    if args.command == "report":
        return _report(args)
    if args.command == "rehearse":
        return _rehearse(args)
    if args.command == "export":
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from raytool.training.export import export_checkpoint

        try:
            print(f"exported: {export_checkpoint(args.ckpt, args.out).resolve()}")
        except RaytoolError as exc:
            print(f"raytool: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command == "parse-tools":
        return _parse_tools(args)
    if args.command == "convert-verl":
        return _convert_verl(args)
    if args.command == "config" and (args.reference or args.explain):
        from raytool.config_reference import explain, reference

        try:
            print(reference() if args.reference else explain(args.explain), end="" if args.reference else "\n")
        except ConfigError as exc:
            print(f"raytool: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        _check_run_flags(args)
        resume = _resume_path(args)
        cfg = load_config(_config_path(args, resume), args.overrides)
    except (ConfigError, OSError, RaytoolError) as exc:
        print(f"raytool: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "verbose", False):
        cfg = msgspec.structs.replace(cfg, logging=msgspec.structs.replace(cfg.logging, console_level="all"))
    if args.command in ("train", "sft", "eval", "chaos"):
        scope.enter_context(console.configured(verbose=cfg.logging.console_level == "all"))
    if args.command == "config":
        print(to_yaml(cfg), end="")
        return 0
    if args.command == "plan":
        return _plan(cfg, args)
    return _run_command(cfg, args, resume)


def _bench(cfg, args) -> int:
    """`raytool bench NAME`: its table, and with --json its result as the last line."""
    if args.link_mbit is not None:
        if args.name != "weight-sync":
            raise ConfigError(f"--link-mbit is for `raytool bench weight-sync`, not {args.name}")
        from raytool.bench.weight_sync import linked_bench

        table, result = linked_bench(cfg, args.link_mbit)
    elif args.trajectories is not None or args.slow_stage is not None:
        if args.name != "load":
            raise ConfigError(f"--{'slow-stage' if args.slow_stage else 'trajectories'} is for `raytool bench load`, not {args.name}")
        from actors.bench_load import bench as load_bench
        from actors.bench_load import slow_stage_bench

        if args.slow_stage:
            table, result = slow_stage_bench(cfg, args.slow_stage, *([args.trajectories] if args.trajectories else []))
        else:
            table, result = load_bench(cfg, args.trajectories)
    else:
        table, result = BENCHES[args.name](cfg)
    print(table)
    if args.json:
        print(json.dumps(result))
    return 0


def _run_command(cfg, args, resume) -> int:
    """A command that runs something (serve, bench, eval, chaos, sft, train) on the loaded config:
    its failure or a signal that stops it ends in one line."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        if args.command == "sandbox":
            from raytool.config import sandbox_backend_options
            from raytool.sandbox.server import serve

            local = msgspec.structs.replace(cfg.sandbox, backend="local")
            serve(args.host, args.port, sandbox_backend_options(local), max_concurrency=cfg.sandbox.max_concurrency)
            return 0
        if args.command == "bench":
            return _bench(cfg, args)
        if args.command == "eval":
            return _eval(cfg, args)
        if args.command == "serve":
            from actors.serve import serve

            serve(cfg, args.host, args.port, args.address)
            return 0
        from actors import pipeline  # lazy: the CLI's imports of the Ray layer

        if args.command == "chaos":
            from actors.chaos import run_chaos, table as chaos_table

            report = run_chaos(cfg, args.run_dir, args.kinds, args.kill_every, args.hang, args.seed,
                               per_step=args.per_step, max_faults=args.max_faults)
            print(chaos_table(report))
            if args.json:
                print(json.dumps(report))
            return 0 if report["ok"] else 1
        if args.command == "sft":
            from actors.sft import run_sft

            run_dir = run_sft(cfg, args.run_dir, args.address, resume, args.overwrite)
        else:
            pipeline.run(cfg, args.run_dir, args.address, resume, args.overwrite)  # it ends on its summary, which names the run directory
            return 0
    except (FileNotFoundError, ConfigError, RaytoolError) as exc:  # a missing model or file, a bad reward fn, a server that cannot start: one line
        where = f" (traceback in {exc.run_log})" if getattr(exc, "run_log", None) else ""
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()  # stops Ray's forwarding of the actors' logs: the reason stays the last line
        print(f"raytool: {exc}{where}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit) as exc:  # Ctrl-C; SIGTERM is Ray's sys.exit(15) once it started
        if isinstance(exc, SystemExit) and exc.code != signal.SIGTERM:
            raise
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()
        name = "SIGTERM" if isinstance(exc, SystemExit) else "SIGINT (Ctrl-C)"
        print(f"raytool: stopped by {name}{_resume_hint(args)}", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(exc, SystemExit) else signal.SIGINT)
    except Exception as exc:
        if not getattr(exc, "run_log", None):  # not from inside a run: Python's own report
            raise
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"raytool: the run failed: {type(exc).__name__}: {first} (traceback in {exc.run_log})", file=sys.stderr)
        return 1
    print(f"run directory: {run_dir.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
