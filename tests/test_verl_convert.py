"""verl's own run scripts (tests/fixtures/verl_scripts, byte for byte) as raytool reads them: their
overrides on raytool's command line pass `raytool config` and `raytool plan` on the first try, and
`raytool convert-verl` turns each into a config that loads, every key's comment naming its verl
override and line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from raytool.config import apply_overrides, config_keys, load_config
from raytool.planner import Cluster, plan
from raytool.verl_convert import convert
from raytool.verl_keys import describe, leaves, read
from raytool.verl_script import read_verl_script

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "fixtures" / "verl_scripts"
ENV = {"PWD": "/work", "HOME": "/home/user"}
# The multi-turn ReTool/DAPO, DAPO and GSM8K GRPO scripts, with the model each trains (raytool plan
# reads its architecture from its table by name: no checkpoint here).
GRPO = {"examples__sglang_multiturn__run_qwen3_4b_dapo_multiturn.sh": "Qwen3-4B", "retool__run_qwen2-32b_dapo.sh": "Qwen2.5-32B-Instruct",
        "retool__run_qwen2_7b_dapo.sh": "Qwen2.5-7B-Instruct", "tests__special_e2e__run_dapo.sh": "Qwen2.5-7B-Instruct",
        "examples__sglang_multiturn__run_qwen2.5-3b_gsm8k_multiturn.sh": "Qwen2.5-1.5B-Instruct"}
FIXTURE_DATA = {"data.train_files": str(REPO / "tests/fixtures/sources/dapo_math_17k.parquet"),
                "data.val_files": str(REPO / "tests/fixtures/sources/aime_2025.parquet")}


def overrides_of(script: str, model: str) -> list[str]:
    """The script's overrides as a verl user pastes them, the data and the model swapped for what this machine has."""
    command = read_verl_script(SCRIPTS / script, env=ENV)
    swapped = {**FIXTURE_DATA, "actor_rollout_ref.model.path": f"/models/{model}"}
    return [f"{key}={swapped.get(key, value)}" for key, value, _ in command.overrides]


@pytest.mark.parametrize("script", sorted(GRPO))
def test_verls_own_grpo_commands_pass_config_and_plan_on_the_first_try(script):
    overrides = overrides_of(script, GRPO[script])
    cfg = load_config(None, overrides)  # raises on any refusal
    reading = read(apply_overrides({}, overrides), {o.partition("=")[0] for o in overrides}, config_keys())
    said = "\n".join(describe(reading))
    for item in overrides:  # every key is read as raytool's, accepted or derived, and named in the notice
        key = item.partition("=")[0]
        assert key in said or (key in dict(leaves(reading.raw)) and key in config_keys()), key
    nodes, per_node = cfg.cluster.nodes, cfg.cluster.gpus_per_node
    result = plan(cfg, Cluster(nodes, per_node, 80.0, 1024.0))
    assert result.roles and cfg.trainer.num_gpus > 0 and cfg.rollout.num_gpus > 0
    used = cfg.trainer.num_workers * cfg.trainer.num_gpus + cfg.rollout.num_servers * cfg.rollout.num_gpus
    assert used <= nodes * per_node  # the split stays within verl's GPUs


def test_the_retool_32b_command_keeps_what_verl_means():
    cfg = load_config(None, overrides_of("retool__run_qwen2-32b_dapo.sh", "Qwen2.5-32B-Instruct"))
    a, t, r = cfg.algorithm, cfg.trainer, cfg.rollout
    assert (a.mini_batches, a.kl_on, a.clip_ratio_c, cfg.data.prompts_per_step, r.n, cfg.eval.n) == (8, False, 10.0, 512, 16, 30)
    assert (t.num_workers, t.sequence_parallel_size, r.num_servers, r.tensor_parallel_size) == (8, 8, 2, 4)
    assert (cfg.agent.max_response_tokens, r.max_tokens_per_turn, cfg.data.max_prompt_tokens) == (16384, 16384, 2048)
    assert cfg.reward.fn == "recipe/retool/retool.py:compute_score" and t.total_epochs == 1 and t.save_every == 30


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_convert_verl_writes_a_config_that_loads_with_a_comment_per_key(script, tmp_path):
    result = convert(SCRIPTS / script, env=ENV)
    path = tmp_path / "run.yaml"
    path.write_text(result.yaml)
    cfg = load_config(path)
    body = [line for line in result.yaml.splitlines() if line.startswith("  ")]
    assert body and all("  # " in line for line in body), [line for line in body if "  # " not in line]
    if script == "examples__grpo_trainer__run_qwen2_5-3b_gsm8k_grpo_lora.sh":  # verl's data.shuffle=False: raytool always shuffles
        assert [line.split(":")[0] for line in result.not_carried] == ["'data.shuffle' False"]
        assert cfg.trainer.lora_rank == 64 and cfg.trainer.num_workers == 1
    else:
        assert result.not_carried == [], result.not_carried
    if script == "retool__run_qwen2-32b_sft.sh":  # verl's SFT trainer under torchrun: `raytool sft`'s keys
        s = cfg.sft
        assert (s.max_length, s.batch_size, s.epochs, cfg.trainer.num_workers, cfg.trainer.sequence_parallel_size) == (16384, 32, 6, 16, 4)
        assert "model.partial_pretrain=" in result.yaml


def test_the_cli_prints_the_config_and_says_what_it_did_not_carry(tmp_path):
    cli = Path(sys.executable).parent / "raytool"
    done = subprocess.run([sys.executable, "-c", "import sys; from raytool.cli import main; sys.exit(main(sys.argv[1:]))", "convert-verl",
                           str(SCRIPTS / "examples__grpo_trainer__run_qwen2_5-3b_gsm8k_grpo_lora.sh"), "trainer.total_epochs=2"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and cli.exists()
    assert "raytool convert-verl: not carried: 'data.shuffle' False" in done.stderr
    assert "total_epochs: 2  # trainer.total_epochs" in done.stdout  # "$@" carries the script's arguments
    missing = subprocess.run([sys.executable, "-m", "raytool.cli", "convert-verl", str(tmp_path / "none.sh")], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and missing.stderr.startswith("raytool: ")
