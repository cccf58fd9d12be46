"""The `raytool` command: train (GRPO with optional SFT warm-up), sft (multi-turn SFT), export (checkpoint -> HF), config, sandbox serve, bench NAME."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import msgspec

from raytool.bench import BENCHES
from raytool.config import ConfigError, load_config, to_yaml
from raytool.errors import RaytoolError


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="run config YAML (default: the embedded tiny CPU config)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=3 rollout.n=4")


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
    sft = sub.add_parser("sft", help="multi-turn SFT on conversations with tool calls (sft.train_files), the ReTool cold start")
    _config_args(sft)
    sft.add_argument("--run-dir", help="where metrics and checkpoints go (default: runs/<timestamp>)")
    sft.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a new local instance)")
    sft.add_argument("--resume", nargs="?", const="latest", metavar="PATH", help="continue from a checkpoint (as for train)")
    export = sub.add_parser("export", help="write an HF checkpoint (safetensors, config, tokenizer) from a raytool checkpoint")
    export.add_argument("--ckpt", required=True, help="a checkpoint directory: runs/<run>/checkpoints/step_N")
    export.add_argument("--out", required=True, help="the HF checkpoint directory to write")
    show = sub.add_parser("config", help="print the resolved config as YAML")
    _config_args(show)
    sandbox = sub.add_parser("sandbox", help="sandbox services")
    sandbox_sub = sandbox.add_subparsers(dest="sandbox_command", required=True)
    serve = sandbox_sub.add_parser("serve", help="serve the local sandbox over a SandboxFusion-compatible HTTP API (POST /run_code)")
    serve.add_argument("--port", type=int, default=8080, help="TCP port (default 8080, as SandboxFusion)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1; 0.0.0.0 to serve other nodes)")
    _config_args(serve)
    bench = sub.add_parser("bench", help="run a benchmark and print its table")
    bench.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    _config_args(bench)
    bench.add_argument("--json", action="store_true", help="also print the result as one JSON object, the last line of stdout")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come after flags too (`raytool bench rollout --json rollout.n=2`), which
    # argparse leaves over: take the leftover `key=value` items as overrides, refuse the rest.
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "export":
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from raytool.training.export import export_checkpoint

        try:
            print(f"exported: {export_checkpoint(args.ckpt, args.out).resolve()}")
        except RaytoolError as exc:
            print(f"raytool: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, OSError) as exc:
        print(f"raytool: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(to_yaml(cfg), end="")
        return 0
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
            table, result = BENCHES[args.name](cfg)
            print(table)
            if args.json:
                print(json.dumps(result))
            return 0
        from actors import pipeline  # lazy: the CLI's only import of the Ray layer

        resume = args.resume
        if resume == "latest":
            resume = args.run_dir or pipeline.latest_run_dir()
        if args.command == "sft":
            from actors.sft import run_sft

            run_dir = run_sft(cfg, args.run_dir, args.address, resume)
        else:
            run_dir = pipeline.run(cfg, args.run_dir, args.address, resume)
    except (FileNotFoundError, RaytoolError) as exc:  # a missing model or file, a server that cannot start: one line
        print(f"raytool: {exc}", file=sys.stderr)
        return 2
    print(f"run directory: {run_dir.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
