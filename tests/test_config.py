import re
from pathlib import Path

import msgspec
import pytest

from raytool.config import ConfigError, RunConfig, load_config, to_yaml

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
    # a choice or another type: both named
    with pytest.raises(ConfigError, match=r"'trainer.micro_batch_tokens': invalid enum value 'lots'; expected 'auto' or an int$"):
        load_config(None, ["trainer.micro_batch_tokens=lots"])
    with pytest.raises(ConfigError, match=r"'trainer.activation_checkpointing': expected `bool \| str`, got `int`; expected 'auto' or true/false$"):
        load_config(None, ["trainer.activation_checkpointing=7"])
    with pytest.raises(ConfigError, match=r"'trainer.micro_batch_tokens': expected `int` >= 1, got 0"):
        load_config(None, ["trainer.micro_batch_tokens=0"])


def test_cross_key_validation():
    with pytest.raises(ConfigError, match="'rollout.n': expected `int` >= 1, got 0"):
        load_config(None, ["rollout.n=0"])


def test_malformed_override():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["trainer.total_steps"])


def test_rollout_engine_keys_are_checked():
    assert load_config(None, ["rollout.max_model_len=2048"]).rollout.max_model_len == 2048
    with pytest.raises(ConfigError, match="rollout.max_model_len"):
        load_config(None, ["rollout.max_model_len=0"])
    with pytest.raises(ConfigError, match=r"rollout.engine.*\['vllm', 'hf', 'scripted'\]"):
        load_config(None, ["rollout.engine=sglang"])


@pytest.mark.parametrize("overrides, key", [
    (["async.max_staleness=-1"], "async.max_staleness"),
    (["async.max_staleness=1", "rollout.engine=hf"], "async.partial_rollout"),
    (["async.max_staleness=2", "rollout.top_p=0.9"], "rollout.top_p"),
    (["async.max_staleness=2", "rollout.top_k=20"], "rollout.top_k"),
    (["algorithm.rollout_correction.rollout_is_threshold=1.0"], "algorithm.rollout_correction.rollout_is_threshold"),
    (["algorithm.rollout_correction.rollout_rs_threshold_lower=2.5"], "algorithm.rollout_correction.rollout_rs_threshold_lower"),
    (["async.partial_rollout=later"], "async.partial_rollout"),
])
def test_asynchronous_settings_that_cannot_hold_name_their_key(overrides, key):
    with pytest.raises(ConfigError, match=re.escape(f"'{key}'")):
        load_config(None, overrides)


def test_asynchronous_settings_load_under_their_yaml_names():
    cfg = load_config(None, ["async.max_staleness=2", "async.partial_rollout=abort", "algorithm.rollout_correction.rollout_rs=token"])
    assert cfg.async_.max_staleness == 2 and cfg.async_.partial_rollout == "abort" and cfg.algorithm.rollout_correction.rollout_rs == "token"
    assert "async:\n  max_staleness: 2" in to_yaml(cfg)
    assert load_config(None, ["async.max_staleness=1", "rollout.engine=hf", "async.partial_rollout=wait"]).async_.max_staleness == 1


@pytest.mark.parametrize("override, key", [
    ("rollout.stall_timeout_s=0", "rollout.stall_timeout_s"),
    ("rollout.max_group_retries=-1", "rollout.max_group_retries"),
    ("reward.call_timeout_s=0", "reward.call_timeout_s"),
    ("reward.retries=-2", "reward.retries"),
    ("cluster.heartbeat_s=-1", "cluster.heartbeat_s"),
    ("trainer.max_failures=-1", "trainer.max_failures"),
    ("trainer.keep_checkpoints=-2", "trainer.keep_checkpoints"),
    ("cluster.max_actor_restarts=-3", "cluster.max_actor_restarts"),
])
def test_fault_settings_out_of_range_name_their_key(override, key):
    with pytest.raises(ConfigError, match=f"config key '{re.escape(key)}'"):
        load_config(None, [override])


def test_the_old_total_request_timeout_is_accepted_ignored_and_warned_about(caplog):
    """Run directories written before stall_timeout_s carry rollout.request_timeout_s: they still resume."""
    cfg = load_config(None, ["rollout.request_timeout_s=600"])
    assert cfg.rollout.stall_timeout_s == 60.0
    assert "'rollout.request_timeout_s' is deprecated and ignored" in caplog.text


@pytest.mark.parametrize("override, line", [
    ("trainer.lr=-1", "command line: config key 'trainer.lr': expected `float` > 0.0, got -1"),
    ("rollout.top_p=5", "command line: config key 'rollout.top_p': expected `float` <= 1.0, got 5"),
    ("sft.epochs=-1", "command line: config key 'sft.epochs': expected `int` >= 1, got -1"),
    ("sft.val_fraction=1.5", "command line: config key 'sft.val_fraction': expected `float` < 1.0, got 1.5"),
    ("trainer.num_gpus=-2", "command line: config key 'trainer.num_gpus': expected `float` >= 0.0, got -2"),
    ("rollout.gpu_memory_utilization=0", "command line: config key 'rollout.gpu_memory_utilization': expected `float` > 0.0, got 0"),
    ("agent.gateway_port=70000", "command line: config key 'agent.gateway_port': expected `int` <= 65535, got 70000"),
    ("trainer.total_stepz=3", "command line: unknown config key 'trainer.total_stepz' (did you mean 'trainer.total_steps'?)"),
    ("trainr.lr=1", "command line: unknown config key 'trainr' (did you mean 'trainer'?)"),
])
def test_numeric_ranges_typos_and_the_command_line_are_named(override, line):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value) == line


def test_a_key_given_twice_is_refused_and_the_file_is_blamed_only_for_its_own_faults(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("trainer:\n  lr: 1.0e-5\nrollout:\n  n: 2\ntrainer:\n  total_steps: 3\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: line 5: key 'trainer' is given twice in the same mapping \(first on line 1\)"):
        load_config(twice)
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  n: 0\n")
    with pytest.raises(ConfigError, match=r"^.*bad.yaml: config key 'rollout.n'"):
        load_config(bad, ["trainer.lr=1e-6"])  # the file's fault, though an override was given
    good = tmp_path / "good.yaml"
    good.write_text("rollout:\n  n: 2\n")
    with pytest.raises(ConfigError, match=r"^command line: config key 'rollout.n'"):
        load_config(good, ["rollout.n=0"])


def test_verl_keys_are_read_as_raytools_with_a_notice_and_the_docs_table_lists_exactly_the_mapping(tmp_path, caplog):
    import logging
    import re

    from raytool.verl_keys import ALIASES, NOT_APPLICABLE

    with caplog.at_level(logging.INFO):
        cfg = load_config(None, ["data.train_batch_size=8", "actor_rollout_ref.actor.optim.lr=1e-6", "trainer.total_training_steps=5",
                                 "trainer.n_gpus_per_node=8", "data.train_files=mine.parquet"])
    assert (cfg.data.prompts_per_step, cfg.trainer.lr, cfg.trainer.total_steps, cfg.cluster.gpus_per_node) == (8, 1e-6, 5, 8)
    assert cfg.data.train_files == ["mine.parquet"]
    assert "verl key 'actor_rollout_ref.actor.optim.lr' read as raytool's 'trainer.lr'" in caplog.text
    nested = tmp_path / "verl.yaml"
    nested.write_text("actor_rollout_ref:\n  rollout:\n    n: 16\n    multi_turn:\n      max_assistant_turns: 8\n")
    cfg = load_config(nested)
    assert (cfg.rollout.n, cfg.agent.max_turns) == (16, 8)
    for overrides, message in ((["trainer.total_epochs=3"], "verl key 'trainer.total_epochs' has no raytool counterpart: raytool counts steps"),
                               (["critic.optim.lr=1e-5"], "verl key 'critic.optim.lr' is not one raytool maps"),
                               (["trainer.lr=1e-5", "actor_rollout_ref.actor.optim.lr=1e-6"], "are both given: keep one")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, overrides)
    for verl, ours in ALIASES.items():  # every alias lands on a key raytool has
        section, key = ours.split(".")
        assert key in {f.encode_name for f in msgspec.structs.fields(type(getattr(RunConfig(), section.replace("async", "async_"))))}, ours
    doc = (REPO / "docs" / "verl.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| (.+) \|$", doc, re.M)
    assert {k: v.strip("`") for k, v in rows if v.startswith("`")} == ALIASES
    assert {k: v for k, v in rows if not v.startswith("`")} == NOT_APPLICABLE
