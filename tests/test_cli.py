from pathlib import Path

import pytest
import yaml

from raytool.cli import main


def test_config_prints_the_resolved_yaml(capsys):
    assert main(["config", "rollout.n=8"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["rollout"]["n"] == 8


def test_bad_config_is_one_line_naming_the_key(capsys):
    assert main(["train", "trainer.total_steps=many"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "trainer.total_steps" in err and "int" in err


def test_missing_model_fails_before_starting_anything(capsys, tmp_path):
    assert main(["train", f"model.path={tmp_path / 'nope'}", "--run-dir", str(tmp_path / "run")]) == 2
    assert "neither a built-in model" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_overrides_may_follow_flags_and_unknown_flags_are_refused(capsys):
    from pathlib import Path

    config = str(Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml")
    assert main(["config", "rollout.n=3", "-c", config, "agent.max_turns=2"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["rollout"]["n"] == 3 and resolved["agent"]["max_turns"] == 2
    with pytest.raises(SystemExit):
        main(["config", "--bogus", "rollout.n=3"])


def test_resume_and_export_without_a_checkpoint_fail_in_one_line(capsys, tmp_path):
    assert main(["train", "--resume", str(tmp_path), "--run-dir", str(tmp_path / "run")]) == 2
    assert main(["export", "--ckpt", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no checkpoint there" in err[0] and "not a raytool checkpoint" in err[1]


def test_sft_without_data_names_the_key(capsys):
    assert main(["sft", "model.path=tiny-random"]) == 2
    assert "sft.train_files" in capsys.readouterr().err


def test_cpu_offload_without_gpus_is_a_config_error(capsys):
    assert main(["train", "trainer.cpu_offload=true"]) == 2
    assert "trainer.cpu_offload" in capsys.readouterr().err


def test_a_bad_reward_fn_stops_train_and_eval_in_one_line_before_any_actor_starts(capsys, tmp_path):
    fn = tmp_path / "reward.py"
    fn.write_text("def score(view):\n    return 1.0\n")
    assert main(["eval", "--model", "tiny-random", f"reward.fn={fn}:score"]) == 2
    assert main(["train", f"reward.fn={fn}:nope", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("raytool: config key 'reward.fn'") for line in err)
    assert "fits neither signature a reward fn may have: raytool's score(trajectory_view, ground_truth, extra)" in err[0] and "has no function 'nope'" in err[1]
    assert not (tmp_path / "run").exists()


def test_a_bad_tool_yaml_or_data_file_stops_train_in_one_line_naming_the_key(capsys, tmp_path):
    bad_tools = tmp_path / "tools.yaml"
    bad_tools.write_text("tools:\n  - class_name: no_such_package.Tool\n")
    for override, key, says in [
        (f"agent.tools={tmp_path / 'missing.yaml'}", "agent.tools", "cannot read tool config"),
        (f"agent.tools={bad_tools}", "agent.tools", "cannot import module 'no_such_package'"),
        (f"data.train_files=[{tmp_path / 'missing.parquet'}]", "data.train_files", "no such file"),
    ]:
        assert main(["train", "data.task=files", f"data.train_files=[{tmp_path / 'x.parquet'}]", override, "--run-dir", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"raytool: config key '{key}'") and says in err[0], err
    assert not (tmp_path / "run").exists()


def test_preprocess_reports_bad_rows_and_unknown_names(capsys, tmp_path):
    from pathlib import Path

    sources = Path(__file__).resolve().parent / "fixtures" / "sources"
    assert main(["preprocess", "gsm8k", "--input", str(sources / "gsm8k.jsonl"), "--output", str(tmp_path / "g.parquet")]) == 0
    out = capsys.readouterr().out
    assert "4 converted, 1 skipped" in out and "gsm8k.jsonl line 5" in out and (tmp_path / "g.parquet").is_file()
    assert main(["preprocess", "mmlu", "--input", str(sources / "gsm8k.jsonl"), "--output", str(tmp_path / "m.parquet")]) == 2
    assert "dapo_math_17k" in capsys.readouterr().err


def test_a_resume_without_a_config_takes_the_runs_own(tmp_path):
    """`raytool train --resume RUN` without -c continues with RUN/config.yaml, not the embedded
    default; -c still wins, and dotted overrides still apply on top."""
    import argparse

    from raytool.cli import _config_path
    from raytool.config import load_config, to_yaml

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(load_config(None, ["trainer.total_steps=7", "async.max_staleness=2"])))
    for resume in (run_dir, run_dir / "checkpoints" / "step_2"):
        path = _config_path(argparse.Namespace(config=None), str(resume))
        assert path == run_dir / "config.yaml"
        assert load_config(path, ["trainer.lr=1e-5"]).trainer.total_steps == 7
    assert _config_path(argparse.Namespace(config="other.yaml"), str(run_dir)) == "other.yaml"
    assert _config_path(argparse.Namespace(config=None), None) is None


def test_a_resume_that_changes_the_model_or_the_algorithm_is_refused_naming_the_key(capsys, tmp_path):
    """The run's own config.yaml is what its checkpoint holds: -c or an override that changes the
    model or the algorithm stops `--resume` in one line before anything starts; other keys may change."""
    from raytool.config import ConfigError, check_resume, load_config, to_yaml

    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / "step_2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "driver_state.json").write_text('{"step": 2}')
    saved = to_yaml(load_config(None, ["model.path=tiny-random"]))
    (run_dir / "config.yaml").write_text(saved)
    check_resume(saved, load_config(None, ["model.path=tiny-random", "trainer.total_steps=99", "trainer.lr=1e-5"]), "saved")
    for override, key in (("model.path=smollm2-135m-instruct", "model.path"), ("algorithm.adv_estimator=rloo", "algorithm.adv_estimator"),
                          ("trainer.lora_rank=8", "trainer.lora_rank")):
        with pytest.raises(ConfigError, match=f"config key '{key}'"):
            check_resume(saved, load_config(None, ["model.path=tiny-random", override]), "saved")
    assert main(["train", "--resume", str(run_dir), "algorithm.adv_estimator=rloo"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'algorithm.adv_estimator'" in err and "'grpo'" in err and str(run_dir / "config.yaml") in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("where", ["local", "memory://"])
def test_a_checkpoint_is_renamed_into_place_only_when_complete(tmp_path, where):
    """A save that dies half-way (here: the trainer raises) leaves the earlier checkpoint of that
    step untouched and nothing that --resume would take; a complete re-save replaces it. The same
    holds on an fsspec object store (fsspec's in-memory one here)."""
    import uuid

    import msgspec

    from actors.drivers.checkpoint import find_checkpoint, save_checkpoint
    from raytool import storage
    from raytool.config import load_config

    class State(msgspec.Struct):
        step: int

    class Trainer:
        def __init__(self, fail: bool = False):
            self.fail = fail

        def save_checkpoint(self, directory: str) -> str:
            storage.write_bytes(storage.join(directory, "dcp", "shard"), b"new" if not self.fail else b"torn")
            if self.fail:
                raise RuntimeError("disk full")
            return directory

    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"trainer.checkpoint_dir={where}{uuid.uuid4().hex}"] if where != "local" else [])
    root = storage.join(cfg.trainer.checkpoint_dir, "run") if where != "local" else str(run_dir / "checkpoints")
    first = save_checkpoint(Trainer(), root, State(3))
    shard = storage.join(first, "dcp", "shard")
    storage.write_bytes(shard, b"old")
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(Trainer(fail=True), root, State(3))
    assert find_checkpoint(run_dir, cfg) == first and storage.read_bytes(shard) == b"old"
    assert save_checkpoint(Trainer(), root, State(3)) == first
    assert storage.read_bytes(shard) == b"new" and msgspec.json.decode(storage.read_bytes(storage.join(first, "driver_state.json"))) == {"step": 3}
    assert storage.children(root) == ["step_3"]
    for step in (4, 5, 6):
        save_checkpoint(Trainer(), root, State(step), keep=2)
    assert sorted(storage.children(root)) == ["step_5", "step_6"] and find_checkpoint(run_dir, cfg) == storage.join(root, "step_6")


def test_a_resume_without_run_dir_continues_the_run_directory_its_checkpoint_names(tmp_path, caplog, monkeypatch):
    """A checkpoint under a shared trainer.checkpoint_dir names the run directory that wrote it: a
    resume without --run-dir continues that directory (not runs/<name> in a job's working copy),
    and says in one line where it writes when that directory is not on this machine."""
    import logging

    from actors.drivers.checkpoint import RUN_DIR_FILE, resumed_run_dir

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "shared" / "runs" / "rl"
    run_dir.mkdir(parents=True)
    checkpoint = tmp_path / "shared" / "checkpoints" / "rl" / "step_2"
    checkpoint.mkdir(parents=True)
    (checkpoint / RUN_DIR_FILE).write_text(str(run_dir))
    assert resumed_run_dir(str(checkpoint)) == run_dir
    (checkpoint / RUN_DIR_FILE).write_text("/elsewhere/runs/rl")
    with caplog.at_level(logging.WARNING, logger="actors.drivers.checkpoint"):
        assert resumed_run_dir(str(checkpoint)) == Path("runs") / "rl"
    assert "its run directory /elsewhere/runs/rl is not on this machine" in caplog.text


def test_contradicting_run_flags_and_a_run_dir_that_is_a_file_are_one_line(capsys, tmp_path):
    """`--resume --overwrite` used to ignore --overwrite, and a --run-dir naming a file was a traceback."""
    assert main(["train", "--resume", str(tmp_path), "--overwrite"]) == 2
    assert capsys.readouterr().err.strip() == "raytool: --resume continues a run and --overwrite replaces it: give one of them"
    (tmp_path / "file").write_text("x")
    assert main(["train", "--run-dir", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err.strip() == f"raytool: --run-dir {tmp_path / 'file'} is a file, not a directory"
