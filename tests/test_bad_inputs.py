"""Bad input a user brings, table-driven: each is refused by `raytool` with exit code 2 and one line
naming the key, file or row and what to do, before any actor starts and with nothing written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from raytool.cli import main

TINY = ["model.path=tiny-random", "trainer.sft_warmup_steps=0"]


@pytest.fixture
def files(tmp_path) -> dict:
    """A prompt file whose second row names a mistyped agent loop, an openai agent file that
    exists, and a run directory holding an earlier run."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "ground_truth": str(i + 1), "data_source": "mine"} for i in range(3)]
    rows[1]["agent_name"] = "tool_agnet"
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "good.jsonl").write_text("".join(json.dumps({**r, "agent_name": None}) + "\n" for r in rows))
    earlier = tmp_path / "earlier"
    (earlier / "checkpoints" / "step_2").mkdir(parents=True)
    (earlier / "config.yaml").write_text("earlier: run\n")
    (earlier / "metrics.jsonl").write_text('{"step": 1}\n')
    return {"d": str(tmp_path)}


CASES = [
    (["train", *TINY, "data.train_files=[{d}/rows.jsonl]"],
     r"{d}/rows.jsonl line 2: agent_name 'tool_agnet' is no agent loop \(did you mean 'tool_agent'\?\)"),
    (["eval", "--model", "tiny-random", "--data", "{d}/rows.jsonl"], r"{d}/rows.jsonl line 2: agent_name 'tool_agnet'"),
    (["train", *TINY, "agent.default_agent=toolagent"], r"config key 'agent.default_agent': no agent loop 'toolagent' \(did you mean 'tool_agent'\?\)"),
    (["train", *TINY, "agent.loop_modules=[my_agents_typo]"], r"config key 'agent.loop_modules': cannot import 'my_agents_typo' \(ModuleNotFoundError"),
    (["train", *TINY, "agent.default_agent=openai", "agent.openai_agent={d}/agnt.py:run"],
     r"config key 'agent.openai_agent': file {d}/agnt.py not found"),
    (["train", *TINY, "agent.default_agent=openai"], r"config key 'agent.openai_agent': rows with agent_name 'openai' need it"),
    (["train", *TINY, "agent.chat_template_kwargs={{add_generation_promt: true}}"],
     r"config key 'agent.chat_template_kwargs': 'add_generation_promt' is not a variable of the model's chat template "
     r"\(did you mean 'add_generation_prompt'\?\)"),
    (["train", *TINY, "data.task=tool_arith", "data.train_files=[{d}/good.jsonl]"], r"config key 'data.task': tool_arith generates its prompts"),
    (["train", *TINY, "--run-dir", "{d}/earlier"],
     r"--run-dir {d}/earlier holds a run \(config.yaml, metrics.jsonl, checkpoints\): continue it with --resume, start elsewhere "
     r"with another --run-dir, or replace it with --overwrite"),
]


@pytest.mark.parametrize("argv, line", CASES, ids=[" ".join(a[:1] + a[3:])[:60] for a, _ in CASES])
def test_bad_input_is_one_line_before_anything_starts(files, capsys, argv, line):
    argv = [a.format(**files) for a in argv]
    if argv[0] == "train" and "--run-dir" not in argv:
        argv += ["--run-dir", f"{files['d']}/new"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    err = [e for e in err if not re.search(r": \d+ rows used, \d+ skipped$", e)]  # the start's count of each data file read before
    assert len(err) == 1 and err[0].startswith("raytool: "), err
    assert re.search(line.format(**files), err[0]), err[0]
    assert not Path(files["d"], "new").exists()  # nothing written
    earlier = Path(files["d"], "earlier")
    assert (earlier / "config.yaml").read_text() == "earlier: run\n" and (earlier / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_overwrite_removes_only_the_earlier_runs_outputs(files):
    from actors.drivers.checkpoint import earlier_run, remove_earlier_run

    earlier = Path(files["d"], "earlier")
    (earlier / "notes.txt").write_text("mine")
    held = earlier_run(earlier, overwrite=True)
    assert held == ["config.yaml", "metrics.jsonl", "checkpoints"]
    remove_earlier_run(earlier, held)
    assert sorted(p.name for p in earlier.iterdir()) == ["notes.txt"]
    assert earlier_run(earlier, overwrite=False) == [] and earlier_run(Path(files["d"], "absent"), overwrite=False) == []


def test_data_and_resume_flags_never_take_an_override_as_a_file():
    from raytool.cli import _take_back_overrides, build_parser

    parser = build_parser()
    args = parser.parse_args(["eval", "--model", "tiny-random", "--data", "tests/fixtures/sources/gsm8k.jsonl", "eval.n=2"])
    _take_back_overrides(args)
    assert args.data == ["tests/fixtures/sources/gsm8k.jsonl"] and args.overrides == ["eval.n=2"]
    args = parser.parse_args(["train", "--resume", "trainer.total_steps=5"])
    _take_back_overrides(args)
    assert args.resume == "latest" and args.overrides == ["trainer.total_steps=5"]
    args = parser.parse_args(["train", "--resume", "runs/a", "trainer.total_steps=5"])
    _take_back_overrides(args)
    assert args.resume == "runs/a" and args.overrides == ["trainer.total_steps=5"]


def test_chat_template_kwargs_are_checked_against_the_models_own_templates(tokenizer, caplog):
    """Qwen3's template reads enable_thinking: a typo of it is refused. Qwen3-Instruct-2507's has no
    thinking mode: verl configs' generic enable_thinking=false there is only said, not refused."""
    import copy
    import logging

    from raytool.agent.render import check_template_kwargs
    from raytool.config import ConfigError

    templates = Path(__file__).parent / "fixtures" / "templates"
    qwen3 = copy.copy(tokenizer)
    qwen3.chat_template = (templates / "qwen3.jinja").read_text()
    check_template_kwargs(qwen3, {"enable_thinking": False})
    with pytest.raises(ConfigError, match=r"'enable_thinkng' is not a variable of the model's chat template \(did you mean 'enable_thinking'\?\)"):
        check_template_kwargs(qwen3, {"enable_thinkng": False})
    instruct = copy.copy(tokenizer)
    instruct.chat_template = (templates / "qwen3_instruct_2507.jinja").read_text()
    with caplog.at_level(logging.WARNING):
        check_template_kwargs(instruct, {"enable_thinking": False})
    assert "'enable_thinking' is not a variable of the model's chat template: it has no effect" in caplog.text
