from pathlib import Path

import pytest

from raytool.config import ConfigError, RunConfig, load_config

REPO = Path(__file__).resolve().parent.parent


def test_embedded_default_equals_tiny_cpu_yaml():
    assert load_config(REPO / "examples" / "tiny_cpu.yaml") == RunConfig()
    assert load_config(None) == RunConfig()


def test_dotted_overrides_are_typed():
    cfg = load_config(REPO / "examples" / "tiny_cpu.yaml", ["rollout.n=8", "trainer.lr=1e-5", "model.path=tiny-random", "cluster.address=null"])
    assert cfg.rollout.n == 8 and cfg.trainer.lr == 1e-5 and cfg.model.path == "tiny-random"
    assert cfg.cluster.address is None


def test_unknown_key_names_the_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer\.total_stepz'"):
        load_config(None, ["trainer.total_stepz=3"])


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(ConfigError, match=r"'trainer\.total_steps'.*expected `int`, got `str`"):
        load_config(None, ["trainer.total_steps=three"])


def test_bad_yaml_file_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  temperature: hot\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: config key 'rollout\.temperature'.*float"):
        load_config(path)


def test_unknown_section_and_bad_literal():
    with pytest.raises(ConfigError, match="unknown config key 'optimizer'"):
        load_config(None, ["optimizer.lr=1"])
    with pytest.raises(ConfigError, match="agent.format"):
        load_config(None, ["agent.format=xml"])
    with pytest.raises(ConfigError, match=r"'logging.logger\[1\]': invalid enum value 'foo'; expected one of \['console', 'tensorboard', 'wandb'\]"):
        load_config(None, ["logging.logger=[console,foo]"])


def test_cross_key_validation():
    with pytest.raises(ConfigError, match="rollout.n.*positive"):
        load_config(None, ["rollout.n=0"])


def test_malformed_override():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["trainer.total_steps"])


def test_rollout_engine_keys_are_checked():
    assert load_config(None, ["rollout.max_model_len=2048"]).rollout.max_model_len == 2048
    with pytest.raises(ConfigError, match="rollout.max_model_len"):
        load_config(None, ["rollout.max_model_len=0"])
    with pytest.raises(ConfigError, match=r"rollout.engine.*\['vllm', 'hf'\]"):
        load_config(None, ["rollout.engine=sglang"])
