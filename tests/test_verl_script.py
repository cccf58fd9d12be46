"""raytool.verl_script: the hydra overrides of verl run scripts, read without running them.

The fixtures are real verl and verl-recipe scripts (tests/fixtures/verl_scripts/README.md). The expected
values below are what bash passes when it runs the script with `python3` replaced by a function that
prints its arguments, except where a command substitution is kept as written.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from raytool.verl_script import VerlCommand, VerlScriptError, parse_verl_script, read_verl_script

SCRIPTS = Path(__file__).parent / "fixtures" / "verl_scripts"
ARGS = ["trainer.total_epochs=3", "+trainer.extra=1"]


def values(cmd: VerlCommand) -> dict[str, str]:
    """key -> value of the command's overrides (the last of a repeated key)."""
    return {key: value for key, value, _ in cmd.overrides}


def lines(cmd: VerlCommand) -> dict[str, int]:
    """key -> line of the command's overrides (the last of a repeated key)."""
    return {key: line for key, _, line in cmd.overrides}


def run(text: str, args: list[str] = (), env: dict[str, str] | None = None) -> VerlCommand:
    """The verl command of a script made of `text`."""
    return parse_verl_script(text, "t.sh", args, env)


def one(text: str, env: dict[str, str] | None = None, args: list[str] = ()) -> str:
    """The value of override `x` in `python3 -m verl.trainer.main_ppo x=<text>`, after `env` assignments."""
    return values(run(f"python3 -m verl.trainer.main_ppo x={text}", args, env))["x"]


# ---------------------------------------------------------------- the real scripts


def test_retool_32b_dapo_data_root_from_env():
    cmd = read_verl_script(SCRIPTS / "retool__run_qwen2-32b_dapo.sh", ARGS, {"DATA_ROOT": "/data", "HDFS_ROOT": "/hdfs"})
    v, at = values(cmd), lines(cmd)
    assert cmd.module == "verl.trainer.main_ppo"
    assert v["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == "18432"  # $(( (2048 + 16384) * 1 ))
    assert v["actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"] == "73728"  # $(( 18432 * 4 ))
    assert v["data.train_files"] == "['/data/dataset/BytedTsinghua-SIA/DAPO-Math-17k']"
    assert v["data.val_files"] == "['/data/dataset/yentinglin/aime_2025']"
    assert v["actor_rollout_ref.model.path"] == "/hdfs/checkpoint/multiturn-sft-qwen-2.5-32b-instruct/global_step_372"
    assert v["trainer.default_local_dir"] == "/data/checkpoint/qwen2.5-32b_dapo"
    # Unquoted ['console','wandb']: bash removes the single quotes; hydra reads the same list.
    assert v["trainer.logger"] == "[console,wandb]"
    assert v["data.truncation"] == "error"
    assert v["actor_rollout_ref.actor.ulysses_sequence_parallel_size"] == "8"  # `train_sp=8 # train`
    assert v["actor_rollout_ref.rollout.multi_turn.max_user_turns"] == "8"
    assert (at["algorithm.adv_estimator"], at["data.truncation"], at["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]) == (53, 63, 79)
    assert cmd.overrides[-3:] == [("trainer.total_epochs", "1", 107), ("trainer.total_epochs", "3", 107), ("trainer.extra", "1", 107)]
    assert len(cmd.overrides) == 57
    assert cmd.unresolved == []


def test_retool_32b_dapo_roots_default_to_pwd():
    cmd = read_verl_script(SCRIPTS / "retool__run_qwen2-32b_dapo.sh", env={"PWD": "/work"})
    assert values(cmd)["data.train_files"] == "['/work/dataset/BytedTsinghua-SIA/DAPO-Math-17k']"
    assert values(cmd)["actor_rollout_ref.model.path"].startswith("/work/checkpoint/")
    assert cmd.unresolved == []


def test_pwd_is_not_read_from_the_process_environment(monkeypatch):
    monkeypatch.setenv("PWD", "/leaked")
    monkeypatch.setenv("HOME", "/leaked")
    cmd = read_verl_script(SCRIPTS / "retool__run_qwen2-32b_dapo.sh")
    assert values(cmd)["data.train_files"] == "['/dataset/BytedTsinghua-SIA/DAPO-Math-17k']"
    assert cmd.unresolved == ["line 4: $PWD is not set; expanded to empty", "line 5: $PWD is not set; expanded to empty"]


def test_retool_7b_dapo_two_files_in_one_quoted_value():
    cmd = read_verl_script(SCRIPTS / "retool__run_qwen2_7b_dapo.sh", env={"DATA_ROOT": "/d", "HDFS_ROOT": "/h"})
    v = values(cmd)
    assert v["data.val_files"] == "['/d/dataset/yentinglin/aime_2025', '/d/dataset/Maxwell-Jia/AIME_2024']"
    assert lines(cmd)["data.val_files"] == 59
    assert v["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == "18432"
    assert v["actor_rollout_ref.rollout.multi_turn.max_assistant_turns"] == "16"
    assert v["trainer.total_epochs"] == "1"  # no args: the bare $@ adds nothing
    assert len(cmd.overrides) == 55
    assert cmd.unresolved == []


def test_retool_sft_torchrun_launcher():
    cmd = read_verl_script(SCRIPTS / "retool__run_qwen2-32b_sft.sh", env={"DATA_ROOT": "/d", "HDFS_ROOT": "/h"})
    v = values(cmd)
    assert cmd.module == "verl.trainer.fsdp_sft_trainer"
    assert cmd.overrides[0] == ("data.train_files", "/d/dataset/wuxibin/ReTool-SFT/data/train-00000-of-00001.parquet", 24)
    assert v["model.partial_pretrain"] == "/h/model/Qwen2.5-32B-Instruct"
    assert v["trainer.default_local_dir"] == "/d/checkpoint/multiturn-sft-qwen-2.5-32b-instruct"
    assert v["trainer.logger"] == '["console","wandb"]'
    assert cmd.overrides[-1] == ("use_remove_padding", "true", 40)  # the file ends without a newline
    assert len(cmd.overrides) == 17
    assert cmd.unresolved == []  # torchrun's own --node-rank=$node_rank is not an override


def test_verl_e2e_dapo_recipe_main_and_arithmetic_chain():
    path = SCRIPTS / "tests__special_e2e__run_dapo.sh"
    cmd = read_verl_script(path, ARGS, {"HOME": "/home/u"})
    v = values(cmd)
    assert cmd.module == "recipe.dapo.main_dapo"
    assert (v["data.train_batch_size"], v["data.gen_batch_size"], v["actor_rollout_ref.actor.ppo_mini_batch_size"]) == ("256", "1024", "128")
    assert v["trainer.n_gpus_per_node"] == "8"
    assert v["actor_rollout_ref.model.path"] == "/home/u/models/Qwen/Qwen2.5-0.5B-Instruct"
    assert v["data.train_files"] == "/home/u/data/gsm8k/train.parquet"
    assert v["actor_rollout_ref.actor.loss_agg_mode"] == "token-mean"
    assert v["trainer.project_name"] == "verl-test"
    assert v["trainer.experiment_name"] == '$(basename "${MODEL_ID,,}")-dapo-minimal'
    assert cmd.unresolved == ['line 42: $(basename "${MODEL_ID,,}") is a command substitution; kept as written']
    assert cmd.overrides[-2:] == [("trainer.total_epochs", "3", 90), ("trainer.extra", "1", 90)]

    fewer = values(read_verl_script(path, env={"HOME": "/home/u", "NUM_GPUS": "4", "MODEL_PATH": "/m"}))
    assert (fewer["data.train_batch_size"], fewer["trainer.n_gpus_per_node"]) == ("128", "4")
    assert fewer["actor_rollout_ref.model.path"] == "/m"


def test_sglang_dapo_multiturn_command_substitution_kept():
    cmd = read_verl_script(SCRIPTS / "examples__sglang_multiturn__run_qwen3_4b_dapo_multiturn.sh", ARGS, {"HOME": "/home/u"})
    v = values(cmd)
    assert v["data.custom_cls.path"] == "$(pwd)/recipe/retool/retool.py"
    assert v["actor_rollout_ref.rollout.multi_turn.tool_config_path"] == "$(pwd)/recipe/retool/sandbox_fusion_tool_config.yaml"
    assert v["data.train_files"] == "/home/u/data/BytedTsinghua-SIA/DAPO-Math-17k"
    assert v["trainer.logger"] == "[console,wandb]"
    assert v["data.truncation"] == "error"
    assert cmd.overrides[0] == ("algorithm.adv_estimator", "grpo", 46)
    assert cmd.overrides[-2:] == [("trainer.total_epochs", "3", 100), ("trainer.extra", "1", 100)]  # `$@` alone on line 100
    assert cmd.unresolved == ["line 5: $(pwd) is a command substitution; kept as written"]


def test_grpo_lora_commented_lines_after_the_command_are_not_overrides():
    cmd = read_verl_script(SCRIPTS / "examples__grpo_trainer__run_qwen2_5-3b_gsm8k_grpo_lora.sh", env={"HOME": "/h"})
    v = values(cmd)
    assert (v["data.train_batch_size"], v["trainer.n_gpus_per_node"]) == ("16", "2")
    assert v["trainer.logger"] == '["console","wandb"]'
    assert v["trainer.project_name"] == "verl_grpo_example_gsm8k"
    assert v["data.val_files"] == "/h/data/gsm8k/test.parquet"
    assert "actor_rollout_ref.model.use_shm" not in v
    assert cmd.overrides[-1] == ("trainer.total_epochs", "15", 46)
    assert len(cmd.overrides) == 43
    assert cmd.unresolved == []


def test_gsm8k_multiturn_config_files_and_function_noted():
    cmd = read_verl_script(SCRIPTS / "examples__sglang_multiturn__run_qwen2.5-3b_gsm8k_multiturn.sh", env={"HOME": "/h"})
    v = values(cmd)
    assert cmd.overrides[0] == ("algorithm.adv_estimator", "grpo", 20)
    assert v["trainer.experiment_name"] == "qwen2.5-3b_baseline_$(now)"
    assert v["trainer.project_name"] == "multi-turn-grpo-qwen2.5-3b-sglang"
    assert "--config-path" not in v and "--config-name" not in v
    assert len(cmd.overrides) == 47
    assert cmd.unresolved == [
        "line 8: $(pwd) is a command substitution; kept as written",
        "line 15: $(now) is a command substitution; kept as written",
        "line 18: --config-path=$(pwd)/examples/sglang_multiturn/config: a hydra config directory; its files are not read",
        "line 19: --config-name=gsm8k_multiturn_grpo: a hydra config file; its keys are not read",
    ]


# ---------------------------------------------------------------- shell forms


def test_quotes():
    cmd = run("python3 -m verl.trainer.main_ppo a='$HOME' b=\"$HOME\" c=\"x y\" d=\\$HOME e=a'b'\"c\" f=\"q\\\"r\"", env={"HOME": "/h"})
    assert values(cmd) == {"a": "$HOME", "b": "/h", "c": "x y", "d": "$HOME", "e": "abc", "f": 'q"r'}


def test_unquoted_expansion_is_split_into_words_quoted_is_not():
    assert values(run('X="a=1 b=2"\npython3 -m verl.trainer.main_ppo $X c="$X"')) == {"a": "1", "b": "2", "c": "a=1 b=2"}


@pytest.mark.parametrize(
    "form, value",
    [
        ("${U:-d}", "d"), ("${E:-d}", "d"), ("${S:-d}", "s"),
        ("${U-d}", "d"), ("${E-d}", ""), ("${S-d}", "s"),
        ("${U:+p}", ""), ("${E:+p}", ""), ("${S:+p}", "p"),
        ("${U+p}", ""), ("${E+p}", "p"),
        ("${S}", "s"), ("$S", "s"), ("${S}x", "sx"), ("$S.x", "s.x"),
        ("${U:-$S/y}", "s/y"), ("${U:-${V:-x}/y}", "x/y"), ('"${U:-q r}"', "q r"),
    ],
)
def test_parameter_expansion(form: str, value: str):
    assert one(form, env={"E": "", "S": "s"}) == value


def test_assigning_default_sets_the_variable():
    assert values(run("python3 -m verl.trainer.main_ppo a=${U:=d} b=$U c=${V=e} d=$V")) == {"a": "d", "b": "d", "c": "e", "d": "e"}


def test_env_and_assignments_in_order():
    text = 'A=${A:-1}\nB="$A/b"\nA=2\nexport C=$A D="x y"\ndeclare -x E=5\nX=9 true\n'
    cmd = run(text + 'python3 -m verl.trainer.main_ppo a=$A b=$B c=$C d="$D" e=$E x=$X', env={"A": "0"})
    assert values(cmd) == {"a": "2", "b": "0/b", "c": "2", "d": "x y", "e": "5", "x": ""}  # `X=9 true`: X only for `true`


def test_arithmetic():
    cmd = run("a=3\nb=4\npython3 -m verl.trainer.main_ppo x=$(( (a + b) * 2 )) y=$(( -7 / 2 )) z=$(( -7 % 2 )) w=$(( $a * 2 )) v=$((a-b))")
    assert values(cmd) == {"x": "14", "y": "-3", "z": "-1", "w": "6", "v": "-1"}
    assert cmd.unresolved == []


def test_arithmetic_unset_name_counts_as_zero_and_is_noted():
    cmd = run("python3 -m verl.trainer.main_ppo x=$(( n + 1 ))")
    assert values(cmd) == {"x": "1"}
    assert cmd.unresolved == ["line 1: n is not set; counted as 0"]


@pytest.mark.parametrize("expr", ["a ** 2", "a << 1", "a / 0", "__import__('os').getpid()", "a if a else 1", "x"])
def test_arithmetic_beyond_integer_operators_kept_as_written(expr: str):
    cmd = run(f"a=2\nx=abc\npython3 -m verl.trainer.main_ppo \\\n  k=$(( {expr} ))")
    assert values(cmd) == {"k": f"$(( {expr} ))"}
    assert cmd.unresolved == [f"line 4: $(( {expr} )) is not integer + - * / % arithmetic; kept as written"]


def test_command_substitution_kept_as_written():
    cmd = run("N=$(nproc)\nT=`date`\npython3 -m verl.trainer.main_ppo \\\n  a=$N b=\"$T\" c=$(echo 'x y')")
    assert values(cmd) == {"a": "$(nproc)", "b": "`date`", "c": "$(echo 'x y')"}
    assert cmd.unresolved == [
        "line 1: $(nproc) is a command substitution; kept as written",
        "line 2: `date` is a command substitution; kept as written",
        "line 4: $(echo 'x y') is a command substitution; kept as written",
    ]


def test_unsupported_parameter_form_kept_as_written():
    cmd = run("M=Qwen\npython3 -m verl.trainer.main_ppo a=${M,,}")
    assert values(cmd) == {"a": "${M,,}"}
    assert cmd.unresolved == ["line 2: ${M,,} is not a supported expansion; kept as written"]


def test_unset_variable_expands_to_empty_and_is_noted():
    cmd = run("python3 -m verl.trainer.main_ppo \\\n  a=$HOME/data")
    assert values(cmd) == {"a": "/data"}
    assert cmd.unresolved == ["line 2: $HOME is not set; expanded to empty"]


def test_script_arguments():
    assert [o[:2] for o in run('python3 -m verl.trainer.main_ppo "$@" z=1').overrides] == [("z", "1")]
    cmd = run('python3 -m verl.trainer.main_ppo "$@" z=$1 n=$#', ["a=1", "b=x y"])
    assert values(cmd) == {"a": "1", "b": "x y", "z": "a=1", "n": "2"}
    assert values(run("python3 -m verl.trainer.main_ppo $*", ["a=1", "b=2"])) == {"a": "1", "b": "2"}


def test_hydra_prefixes_and_lists():
    cmd = run("a=/x/a\nb=/x/b\npython3 -m verl.trainer.main_ppo +p=1 ++q=2 r=[1,2] data.train_files=\"['$a', '$b']\"")
    assert values(cmd) == {"p": "1", "q": "2", "r": "[1,2]", "data.train_files": "['/x/a', '/x/b']"}


def test_config_flags_and_stray_tokens_noted():
    cmd = run("python3 -m verl.trainer.main_ppo --config-name ppo -cp=/c --multirun a=1 plain")
    assert cmd.overrides == [("a", "1", 1)]
    assert cmd.unresolved == [
        "line 1: --config-name=ppo: a hydra config file; its keys are not read",
        "line 1: -cp=/c: a hydra config directory; its files are not read",
        "line 1: --multirun: not a key=value override; ignored",
        "line 1: plain: not a key=value override; ignored",
    ]


def test_comments_continuations_and_line_numbers():
    text = "set -x  # trace\n\n# python3 -m verl.trainer.main_ppo no=1\npython3 -m verl.trainer.main_ppo \\\n  a=1 \\\n  b=2#x # c=3\n"
    assert run(text).overrides == [("a", "1", 5), ("b", "2#x", 6)]


def test_comment_line_inside_a_continuation_ends_the_command():
    cmd = run("python3 -m verl.trainer.main_ppo \\\n  a=1 \\\n  # b=2 \\\n  c=3\n")
    assert cmd.overrides == [("a", "1", 2)]


def test_redirections_pipes_and_other_commands():
    text = "ulimit -n 65535\ncd /tmp && pip install -U x\npython3 -m verl.trainer.main_ppo a=1 > log 2>&1 b=2 | tee out.txt"
    assert values(run(text)) == {"a": "1", "b": "2"}


@pytest.mark.parametrize("launcher", ["python", "python3", "python3.10", "/usr/bin/python3 -u", "torchrun --nproc_per_node=8", "nohup python"])
def test_launchers(launcher: str):
    assert run(f"{launcher} -m verl.trainer.main_ppo a=1").overrides == [("a", "1", 1)]


def test_which_of_several_commands():
    text = "python3 -m verl.trainer.main_ppo a=1\npython3 -m recipe.dapo.main_dapo a=2\npython3 -m verl.model_merger merge a=3\n"
    assert run(text).module == "recipe.dapo.main_dapo"
    assert run("python3 -m verl.model_merger a=1\npython3 -m verl.utils.x a=2").module == "verl.utils.x"
    assert run("python3 -m pip install x\npython3 -m verl.trainer.main_ppo a=1").module == "verl.trainer.main_ppo"


def test_no_verl_command_names_the_file(tmp_path: Path):
    path = tmp_path / "train.sh"
    path.write_text("set -x\npython3 -m pip install verl\npython3 train.py a=1\n")
    with pytest.raises(VerlScriptError, match="train.sh: no `python -m verl"):
        read_verl_script(path)


@pytest.mark.parametrize(
    "text, line, what",
    [("x='a\n", 1, "a single quote"), ('a=1\nx="a\n', 2, "a double quote"), ("\n\nx=$(ls\n", 3, "`$(`"), ("x=`ls", 1, "a backtick")],
)
def test_unclosed_quote_names_file_and_line(text: str, line: int, what: str):
    with pytest.raises(VerlScriptError) as err:
        parse_verl_script(text, "run.sh")
    assert str(err.value) == f"run.sh: line {line}: {what} is not closed"
