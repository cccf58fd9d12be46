"""The console of a run: which records it shows, the start banner, the end summary."""

from __future__ import annotations

import json
import logging
import warnings

import pytest

from raytool import console
from raytool.config import load_config


def _record(name: str, level: int, message: str = "m") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_the_console_shows_its_own_lines_raytools_warnings_and_every_error_only():
    keep = console.OwnLines().filter
    assert keep(_record("raytool.console", logging.INFO))
    assert keep(_record("actors.drivers.pipeline", logging.WARNING)) and keep(_record("raytool.streaming", logging.WARNING))
    assert keep(_record("vllm.engine", logging.ERROR))
    assert not keep(_record("raytool.resolve", logging.INFO))  # raytool's other information: run.log
    counted = _record("raytool.data.rows", logging.INFO, "train.parquet: 3 rows used, 1 skipped")
    counted.console = True  # logged with extra=console.CONSOLE: each data file's count, which the docs promise at start
    assert keep(counted)
    assert not keep(_record("py.warnings", logging.WARNING)) and not keep(_record("ray", logging.WARNING))
    assert not keep(_record("vllm.platforms", logging.WARNING))
    fmt = console.ConsoleFormat()
    assert fmt.format(_record("raytool.console", logging.INFO, "step 1")) == "step 1"
    assert fmt.format(_record("actors.drivers.watchdog", logging.WARNING, "lost")) == "warning: lost"
    assert fmt.format(_record("vllm.engine", logging.ERROR, "boom")) == "error (vllm.engine): boom"


def test_python_warnings_and_others_information_reach_run_log_not_the_console(capsys, tmp_path, monkeypatch):
    from actors.drivers.session import ray_logs_through_root

    root, ray_logger = logging.getLogger(), logging.getLogger("ray")
    monkeypatch.setattr(ray_logger, "handlers", list(ray_logger.handlers))  # put back after the test
    monkeypatch.setattr(ray_logger, "propagate", ray_logger.propagate)
    run_log = logging.FileHandler(tmp_path / "run.log")
    with console.configured(verbose=False):
        ray_logs_through_root()  # as the driver's connect does on a quiet console
        root.addHandler(run_log)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.warn("torch.distributed.reduce_op is deprecated", FutureWarning)
            logging.getLogger("ray").warning("Token authentication is enabled")
            logging.getLogger("raytool.resolve").info("model.dtype auto: bfloat16")
            console.show(["raytool: tiny-random"])
            logging.getLogger("raytool.streaming").warning("group g1 rolled out again")
        finally:
            root.removeHandler(run_log)
            run_log.close()
    assert capsys.readouterr().err.splitlines() == ["raytool: tiny-random", "warning: group g1 rolled out again"]
    kept = (tmp_path / "run.log").read_text()
    for line in ("reduce_op is deprecated", "Token authentication", "model.dtype auto", "raytool: tiny-random", "rolled out again"):
        assert line in kept


def test_verbose_shows_everything(capsys):
    with console.configured(verbose=True):
        logging.getLogger("vllm.platforms").warning("Triton is not installed")
        logging.getLogger("raytool.resolve").info("model.dtype auto: bfloat16")
    err = capsys.readouterr().err
    assert "WARNING vllm.platforms: Triton is not installed" in err and "INFO raytool.resolve: model.dtype auto" in err


def test_a_command_leaves_logging_as_it_found_it(monkeypatch, tmp_path):
    """`main` run in a process that goes on (tests, notebooks): its console comes and goes with it."""
    from actors.drivers import pipeline
    from raytool.cli import main

    root, ray_logger = logging.getLogger(), logging.getLogger("ray")
    before = (list(root.handlers), root.level, list(ray_logger.handlers), ray_logger.propagate, warnings.showwarning)
    monkeypatch.setattr(pipeline, "run", lambda *args, **kwargs: None)
    assert main(["train", "model.path=tiny-random", "--run-dir", str(tmp_path / "run")]) == 0
    assert (list(root.handlers), root.level, list(ray_logger.handlers), ray_logger.propagate, warnings.showwarning) == before


def _write_metrics(run_dir, rows):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_summary_reads_the_runs_metrics(tmp_path):
    rows = [{"step": 0, "val-core/tool_arith/acc/mean@4": 0.25, "val-aux/tool/calls_per_traj": 0.5}]
    rows += [{"step": s, "critic/score/mean": score} for s, score in enumerate([0.1, 0.3, 0.5, 0.5, 0.7, 0.9], start=1)]
    rows[-1].update({"val-core/tool_arith/acc/mean@4": 0.75, "val-aux/tool/calls_per_traj": 1.25})
    _write_metrics(tmp_path, rows)
    (tmp_path / "sft_metrics.jsonl").write_text("{}\n" * 3)
    lines = console.summary(tmp_path, 125.4, str(tmp_path / "checkpoints" / "step_6" / "hf"))
    assert lines[0] == "done: 6 GRPO steps after 3 SFT warm-up steps in 2 min 05 s"
    assert lines[1] == "reward (mean score): 0.20 over steps 1-2 -> 0.80 over steps 5-6"
    assert lines[2] == "held-out accuracy (tool_arith, mean@4): 0.25 at step 0 -> 0.75 at step 6"
    assert lines[3] == "tool calls per held-out trajectory: 0.50 -> 1.25"
    assert lines[4].startswith(f"final model: {tmp_path / 'checkpoints' / 'step_6'} (checkpoint)")
    assert lines[5] == f"next: raytool report {tmp_path}   (curves and trajectories in the browser)"
    assert f"raytool eval --model {tmp_path}" in lines[6]


def test_a_summary_without_validation_or_final_model_says_what_it_has(tmp_path):
    _write_metrics(tmp_path, [{"step": 1, "critic/score/mean": 0.5}])
    lines = console.summary(tmp_path, 3.0)
    assert lines == ["done: 1 GRPO steps in 0 min 03 s", "reward (mean score): 0.50 over step 1 -> 0.50 over step 1",
                     f"next: raytool report {tmp_path}   (curves and trajectories in the browser)"]


def test_the_banner_fits_in_eight_lines_on_any_cluster(tmp_path):
    cfg = load_config(None, ["model.path=tiny-random", "model.dtype=bfloat16"])
    nodes = {f"10.0.0.{i}": {"TrainerWorker": 8} for i in range(6)}
    nodes["10.0.0.0"] = {"RolloutServer": 2, "AgentLoopWorker": 1, "LLMManager": 1, "SandboxPool": 1}
    first = console.banner(cfg, "/models/tiny", tmp_path)
    then = console.placement(nodes, "http://127.0.0.1:8265")
    assert len(first + then) <= 8
    assert first[0] == "raytool: tiny-random (/models/tiny)"
    assert "compute bfloat16" in first[1] and "engine: vllm, bfloat16 weights" in first[1]  # auto follows model.dtype's resolution
    assert first[2] == "  plan: 12 SFT warm-up steps, then 12 GRPO steps of 4 prompts x 4 samples; held-out accuracy before and after training"
    assert then[0] == "  on 10.0.0.0: 2 rollout servers, 1 agent worker, 1 sandbox pool, 1 LLM manager"
    assert then[1] == "  on 10.0.0.1: 8 trainer ranks" and then[2] == "  and 4 more nodes (the dashboard lists them)"
    assert then[-1] == "  dashboard: http://127.0.0.1:8265"
    quiet = load_config(None, ["model.path=tiny-random", "trainer.sft_warmup_steps=0", "eval.before_train=false"])
    assert console.banner(quiet, "/m", tmp_path)[2] == "  plan: 12 GRPO steps of 4 prompts x 4 samples; held-out accuracy after training"


def test_a_run_that_fails_of_anything_ends_on_one_line_naming_its_log(monkeypatch, capsys, tmp_path):
    from actors.drivers import pipeline
    from raytool.cli import main

    def failing_run(*args, **kwargs):
        exc = KeyError("policy_version")
        exc.run_log = str(tmp_path / "run.log")
        raise exc

    monkeypatch.setattr(pipeline, "run", failing_run)
    assert main(["train", "model.path=tiny-random", "--run-dir", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"raytool: the run failed: KeyError: 'policy_version' (traceback in {tmp_path / 'run.log'})"]


@pytest.mark.parametrize("signal_exc, code, name", [(KeyboardInterrupt(), 130, "SIGINT (Ctrl-C)"), (SystemExit(15), 143, "SIGTERM")])
def test_a_signal_ends_a_run_in_one_line_with_its_resume_command(monkeypatch, capsys, tmp_path, signal_exc, code, name):
    """Ctrl-C printed a 35-line traceback, and SIGTERM (Ray's handler: sys.exit(15)) a stack dump."""
    from actors.drivers import pipeline
    from raytool.cli import main

    def stopped(*args, **kwargs):
        raise signal_exc

    monkeypatch.setattr(pipeline, "run", stopped)
    assert main(["train", "model.path=tiny-random", "--run-dir", str(tmp_path / "run")]) == code
    assert capsys.readouterr().err.strip().splitlines() == [
        f"raytool: stopped by {name}; the steps after the last checkpoint are lost; continue with: raytool train --resume {tmp_path / 'run'}"]


def test_trace_samples_are_taken_from_as_many_groups_as_they_need(monkeypatch):
    """logging.trace_samples=5 with groups of 2 wrote 2 trajectories: the first group's."""
    from actors.drivers import pipeline
    from raytool.streaming import GroupRefs, RolloutBatch, RolloutGroup

    monkeypatch.setattr(pipeline.ray, "get", lambda ref: ref)  # each group's trajectories "ref" is its trajectories here
    groups = [RolloutGroup(f"g{i}", i, None, GroupRefs([f"t{i}a", f"t{i}b"], None), [], 0) for i in range(4)]
    assert pipeline.traced(RolloutBatch(groups, 0), 5) == ["t0a", "t0b", "t1a", "t1b", "t2a"]
    assert pipeline.traced(RolloutBatch(groups, 0), 1) == ["t0a"]
