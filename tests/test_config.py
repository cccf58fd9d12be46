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


def test_verl_keys_are_read_as_raytools_with_a_notice_and_the_docs_tables_list_exactly_the_mapping(tmp_path, caplog):
    import logging
    import re

    from raytool.verl_keys import ALIASES, ALWAYS, DERIVED, NOT_APPLICABLE

    with caplog.at_level(logging.INFO):
        cfg = load_config(None, ["data.train_batch_size=8", "actor_rollout_ref.actor.optim.lr=1e-6", "trainer.total_training_steps=5",
                                 "trainer.n_gpus_per_node=8", "data.train_files=mine.parquet"])
    assert (cfg.data.prompts_per_step, cfg.trainer.lr, cfg.trainer.total_steps, cfg.cluster.gpus_per_node) == (8, 1e-6, 5, 8)
    assert cfg.data.train_files == ["mine.parquet"]
    assert "read as raytool's: actor_rollout_ref.actor.optim.lr -> trainer.lr=1e-06" in caplog.text
    nested = tmp_path / "verl.yaml"
    nested.write_text("actor_rollout_ref:\n  rollout:\n    n: 16\n    multi_turn:\n      max_assistant_turns: 8\n")
    cfg = load_config(nested)
    assert (cfg.rollout.n, cfg.agent.max_turns) == (16, 8)
    for verl, ours in ALIASES.items():  # every alias lands on a key raytool has
        section, key = ours.split(".")
        assert key in {f.encode_name for f in msgspec.structs.fields(type(getattr(RunConfig(), section.replace("async", "async_"))))}, ours
    doc = (REPO / "docs" / "verl.md").read_text()
    rows = [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in doc.splitlines()
            if line.startswith("| `")]
    assert {r[0].strip("`"): r[1].strip("`") for r in rows if len(r) == 2 and r[1].startswith("`")} == ALIASES
    assert {r[0].strip("`"): r[2] for r in rows if len(r) == 3} == {k: d for k, (_, d) in ALWAYS.items()}
    assert {r[0].strip("`"): r[1] for r in rows if len(r) == 2 and not r[1].startswith("`")} == DERIVED | NOT_APPLICABLE


def test_a_whole_verl_command_is_read_in_one_pass_and_every_refusal_comes_in_one_message():
    """The issue's traps: 22 refusals one key at a time, KL switches that meant the opposite,
    save_freq=-1 refused, a verl key that could not override the config's own value."""
    from raytool.verl_keys import AR

    cfg = load_config(None, ["algorithm.use_kl_in_reward=False", "algorithm.kl_ctrl.kl_coef=0.001", f"{AR}.actor.use_kl_loss=False",
                             f"{AR}.actor.kl_loss_coef=0.001", "data.return_raw_chat=True", f"{AR}.rollout.name=vllm",
                             f"{AR}.rollout.mode=async", f"{AR}.rollout.multi_turn.enable=True", f"{AR}.model.use_remove_padding=True",
                             f"{AR}.actor.use_dynamic_bsz=True", "data.filter_overlong_prompts=True", "data.train_batch_size=512",
                             f"{AR}.actor.ppo_mini_batch_size=64", "custom_reward_function.path=recipe/retool/retool.py",
                             "custom_reward_function.name=compute_score", "trainer.save_freq=-1", "trainer.test_freq=-1",
                             "trainer.total_epochs=2", f"{AR}.actor.kl_loss_type=low_var_kl", "data.max_prompt_length=2048",
                             f"{AR}.rollout.multi_turn.max_user_turns=8", f"{AR}.rollout.multi_turn.max_assistant_turns=8"])
    a = cfg.algorithm
    assert (a.kl_reward_coef, a.kl_loss_coef, a.kl_on, a.mini_batches, a.kl_type) == (0.0, 0.0, False, 8, "k3")
    assert cfg.reward.fn == "recipe/retool/retool.py:compute_score" and (cfg.trainer.save_every, cfg.eval.every) == (0, 0)
    assert (cfg.trainer.total_epochs, cfg.data.max_prompt_tokens, cfg.data.overlong_prompts) == (2, 2048, "drop")
    on = load_config(None, ["algorithm.use_kl_in_reward=True", f"{AR}.actor.use_kl_loss=True", f"{AR}.actor.kl_loss_coef=0.01"])
    assert (on.algorithm.kl_reward_coef, on.algorithm.kl_loss_coef) == (0.001, 0.01)  # verl's default kl_ctrl.kl_coef
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.val_only=True", "critic.optim.lr=1e-5", f"{AR}.actor.optim.lrr=1e-6", "data.truncation=left",
                           f"{AR}.actor.ppo_mini_batch_size=3", "data.train_batch_size=8", "reward_model.reward_manager=batch",
                           f"{AR}.rollout.multi_turn.enable=False", "trainer.lr=1e-5", f"{AR}.actor.optim.lr=1e-6"])
    lines = str(err.value).splitlines()
    assert lines[0] == "command line: 8 verl keys raytool cannot take (docs/verl.md):"
    text = str(err.value)
    for part in ("'trainer.val_only': validation alone is `raytool eval",
                 "'critic.optim.lr' is not a key raytool knows, in verl's names or its own",
                 f"'{AR}.actor.optim.lrr' is not a key raytool knows, in verl's names or its own (the nearest verl key raytool reads: {AR}.actor.optim.lr",
                 "'data.truncation' 'left': raytool renders each prompt from its messages and cannot cut it",
                 f"'{AR}.actor.ppo_mini_batch_size' (3) must divide 'data.train_batch_size' (8)",
                 "'reward_model.reward_manager' 'batch'", f"'{AR}.rollout.multi_turn.enable' False",
                 f"'{AR}.actor.optim.lr' and raytool's 'trainer.lr' are both given"):
        assert part in text, part


def test_a_verl_key_on_the_command_line_overrides_the_files_value_of_the_same_knob(tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text("trainer:\n  lr: 1.0e-5\n  save_every: 5\ndata:\n  prompts_per_step: 16\n")
    cfg = load_config(recipe, ["actor_rollout_ref.actor.optim.lr=1e-6", "trainer.save_freq=-1", "data.train_batch_size=32"])
    assert (cfg.trainer.lr, cfg.trainer.save_every, cfg.data.prompts_per_step) == (1e-6, 0, 32)
    verl_file = tmp_path / "verl.yaml"
    verl_file.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1.0e-6\n")
    assert load_config(verl_file, ["trainer.lr=3e-6"]).trainer.lr == 3e-6  # raytool's key typed on the command line wins too
    both = tmp_path / "both.yaml"
    both.write_text("trainer:\n  lr: 1.0e-5\nactor_rollout_ref:\n  actor:\n    optim:\n      lr: 1.0e-6\n")
    with pytest.raises(ConfigError, match="both given"):
        load_config(both)


def test_verls_gpus_are_split_into_trainer_ranks_and_rollout_servers():
    from raytool.verl_keys import AR, split_gpus

    assert split_gpus(8, 1, 1) == (4, 4, False) and split_gpus(16, 4, 8) == (8, 2, False) and split_gpus(1, 1, 1) == (1, 1, True)
    cfg = load_config(None, ["trainer.nnodes=1", "trainer.n_gpus_per_node=4", f"{AR}.actor.ulysses_sequence_parallel_size=4"])
    t, r = cfg.trainer, cfg.rollout
    assert (t.num_workers, t.num_gpus, r.num_servers, r.num_gpus, t.sequence_parallel_size) == (4, 0.5, 4, 0.5, 4)
    assert r.gpu_memory_utilization == 0.45
    cfg = load_config(None, ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", f"{AR}.rollout.tensor_model_parallel_size=4"])
    assert (cfg.trainer.num_workers, cfg.rollout.num_servers, cfg.rollout.num_gpus, cfg.cluster.nodes) == (8, 2, 4.0, 2)
    with pytest.raises(ConfigError, match=r"\(2 GPUs\) is not a multiple of both the sequence-parallel size \(4"):
        load_config(None, ["trainer.n_gpus_per_node=2", "trainer.nnodes=1", f"{AR}.actor.ulysses_sequence_parallel_size=4"])


def test_a_tensor_parallel_rollout_without_accelerators_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"config keys 'rollout.tensor_parallel_size' \(2\) and 'rollout.num_gpus' \(0\)"):
        load_config(None, ["rollout.tensor_parallel_size=2"])
    assert load_config(None, ["rollout.tensor_parallel_size=2", "rollout.num_gpus=2"]).rollout.num_gpus == 2
