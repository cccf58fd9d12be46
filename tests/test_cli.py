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
