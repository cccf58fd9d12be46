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
