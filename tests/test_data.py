import pytest

from raytool.config import load_config
from raytool.data import PromptLoader, make_splits
from raytool.data.task import load_task
from raytool.data.tool_arith import SEEN, TEMPLATES, UNSEEN, prompt_row, sft_messages


def test_splits_are_deterministic_and_disjoint():
    train_a, val_a = make_splits(200, 40, seed=3)
    train_b, val_b = make_splits(200, 40, seed=3)
    assert train_a == train_b and val_a == val_b
    assert not {p.question for p in train_a} & {p.question for p in val_a}
    assert make_splits(200, 40, seed=4)[0] != train_a


def test_answers_come_from_running_each_step_on_the_previous_output():
    train, _ = make_splits(80, 5, seed=0)
    assert {p.template for p in train} == set(TEMPLATES)
    for p in train:
        assert p.outputs[-1] == p.answer and int(p.answer) >= 0
        assert len(p.steps) == len(p.outputs)
        if len(p.steps) == 2:  # the second call uses the first call's printed value, as a model would
            assert p.steps[1].startswith(f"print({p.outputs[0]} % ")
            total, modulus = p.steps[1].removeprefix("print(").removesuffix(")").split(" % ")
            assert int(p.answer) == int(total) % int(modulus)
    marbles = next(p for p in train if p.template == "shared_marbles")
    a, b = marbles.steps[0].removeprefix("print(").removesuffix(")").split(" % ")
    assert f"{a} marbles" in marbles.question and f"among {b} children" in marbles.question


def test_sft_trace_has_one_call_per_step():
    train, _ = make_splits(16, 1, seed=0)
    two_step = next(p for p in train if len(p.steps) == 2)
    msgs = sft_messages(two_step)
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert two_step.steps[1] in msgs[4].content and msgs[5].content == two_step.answer
    assert f"\\boxed{{{two_step.answer}}}" in msgs[6].content


def test_held_out_templates_never_reach_the_sft_traces_and_report_as_their_own_source():
    task = load_task(load_config(overrides=["data.train_size=64", "data.val_size=16"]))
    held_out = {name for name, (_, in_sft) in TEMPLATES.items() if not in_sft}
    assert held_out
    traced_questions = {trace[1].content for trace in task.sft_traces}
    held_out_train = [r for r in task.train if r.extra_info["template"] in held_out]
    assert held_out_train and not traced_questions & {r.prompt[1].content for r in held_out_train}
    assert {r.data_source for r in task.val} == {SEEN, UNSEEN}
    assert all((r.data_source == UNSEEN) == (r.extra_info["template"] in held_out) for r in task.val)


def test_system_prompt_override_reaches_prompt_rows():
    problem = make_splits(1, 1, seed=0)[0][0]
    assert prompt_row(problem, "Be brief.").prompt[0].content == "Be brief."


def test_prompt_loader_resumes_where_it_stopped():
    items = list(range(10))
    a = PromptLoader(items, 4, seed=1)
    first = [a.next_batch() for _ in range(2)]
    state = a.state_dict()
    rest = [a.next_batch() for _ in range(3)]
    b = PromptLoader(items, 4, seed=1)
    b.load_state_dict(state)
    assert [b.next_batch() for _ in range(3)] == rest
    seen = [x for batch in first for x in batch] + rest[0][:2]
    assert sorted(seen) == items  # an epoch visits every item once


def test_prompts_that_cannot_fit_the_context_with_the_response_budget_are_left_out_and_named():
    from raytool.data.prompts import PromptRow, drop_too_long
    from raytool.types import Message

    rows = [PromptRow(prompt=[Message("user", "x " * n)], ground_truth="1", data_source="d") for n in (10, 500, 20, 900)]
    kept, line = drop_too_long(rows, lambda row: len(row.prompt[0].content) // 2, context=512, response_budget=256, what="training data")
    assert kept == [rows[0], rows[2]]
    assert line == ("training data: 2 of 4 prompts left out: a prompt with agent.max_response_tokens=256 after it does not fit the engine's "
                    "context of 512 tokens (rollout.max_model_len); rows 1 (500 tokens), 3 (900 tokens)")
    assert drop_too_long(rows[:1], lambda row: 10, 1024, 256, "x") == (rows[:1], "")


def test_a_prompt_over_max_prompt_tokens_is_left_out_or_with_overlong_prompts_error_stops_the_run_naming_its_row():
    from raytool.data.prompts import PromptRow, drop_too_long
    from raytool.data.rows import DataError
    from raytool.types import Message

    rows = [PromptRow(prompt=[Message("user", "x " * n)], ground_truth="1", data_source="d", origin=f"train.parquet row {i} (0-based)")
            for i, n in enumerate((10, 300, 20))]
    kept, line = drop_too_long(rows, lambda row: len(row.prompt[0].content) // 2, 4096, 256, "training data", max_prompt=100)
    assert kept == [rows[0], rows[2]] and "over data.max_prompt_tokens=100" in line and "rows 1 (300 tokens)" in line
    with pytest.raises(DataError, match=r"^training data: train.parquet row 1 \(0-based\): a prompt of 300 tokens is over "
                                        r"data.max_prompt_tokens=100 \(data.overlong_prompts=error"):
        drop_too_long(rows, lambda row: len(row.prompt[0].content) // 2, 4096, 256, "training data", max_prompt=100, overlong="error")


def test_verls_epochs_are_whole_batches_of_the_usable_prompts_and_the_turn_limit_follows_the_response_budget():
    from raytool.config import load_config
    from raytool.resolve import with_epochs

    cfg = with_epochs(load_config(None, ["trainer.total_epochs=3", "data.prompts_per_step=4"]), 10)
    assert (cfg.trainer.total_steps, cfg.trainer.total_epochs) == (6, None)  # 2 whole batches a pass; the last 2 prompts wait
    assert with_epochs(load_config(None, []), 10).trainer.total_steps == 12  # no epochs: unchanged
    assert load_config(None, ["data.max_response_length=16384"]).rollout.max_tokens_per_turn == 16384
    assert load_config(None, ["agent.max_response_tokens=500", "rollout.max_tokens_per_turn=50"]).rollout.max_tokens_per_turn == 50
    assert load_config(None, []).rollout.max_tokens_per_turn == 96


def _verl_rows(path):
    """Rows as verl's ReTool / DAPO preprocessing writes them: reward_model and extra_info as parquet
    structs, the tools' per-row create_kwargs, an agent loop per row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "math_dapo", "prompt": [{"content": f"What is {i} + {i}?", "role": "user"}], "ability": "MATH",
             "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"}, "agent_name": "tool_agent",
             "extra_info": {"index": i, "need_tools_kwargs": True, "interaction_kwargs": {"name": "check"},
                            "tools_kwargs": {"code_interpreter": {"create_kwargs": {"ground_truth": str(2 * i)}}}}}
            for i in range(3)]
    rows.append({**rows[0], "prompt": []})  # a bad row: skipped, named
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_naming_train_files_trains_on_them_verl_rows_as_they_are(tmp_path, caplog):
    import logging

    path = _verl_rows(tmp_path / "mine.parquet")
    cfg = load_config(overrides=[f"data.train_files=[{path}]"])  # the embedded default config, no data.task
    with caplog.at_level(logging.INFO):
        task = load_task(cfg)
    assert [r.ground_truth for r in task.train] == ["0", "2", "4"] and task.val == [] and task.sft_traces == []
    row = task.train[1]
    assert row.data_source == "math_dapo" and row.agent_name == "tool_agent" and row.prompt[-1].content == "What is 1 + 1?"
    assert row.extra_info["tools_kwargs"] == {"code_interpreter": {"create_kwargs": {"ground_truth": "2"}}}
    assert row.extra_info["interaction_kwargs"] == {"name": "check"}
    assert f"{path}: 3 rows used, 1 skipped" in caplog.text and f"{path} row 3 (0-based)" in caplog.text


def test_the_real_dapo_schema_reads_without_preprocessing():
    from pathlib import Path

    path = Path(__file__).parent / "fixtures" / "sources" / "dapo_math_17k.parquet"
    task = load_task(load_config(overrides=[f"data.train_files=[{path}]"]))
    assert [r.ground_truth for r in task.train] == ["100", "10", "8"]  # the rows with no answer and no question are skipped


def test_a_generated_task_says_so_and_a_conflicting_task_or_lone_validation_files_are_one_line(tmp_path, caplog):
    import logging

    import pytest

    from raytool.config import ConfigError

    with caplog.at_level(logging.INFO):
        load_task(load_config(overrides=["data.train_size=8", "data.val_size=2"]))
    assert "train 8 and validation 2 generated tool_arith problems" in caplog.text
    path = _verl_rows(tmp_path / "mine.parquet")
    for overrides, key in ((["data.task=tool_arith", f"data.train_files=[{path}]"], "data.task"),
                           ([f"data.val_files=[{path}]"], "data.val_files"), (["data.task=files"], "data.train_files")):
        with pytest.raises(ConfigError, match=rf"config key '{key}'") as err:
            load_config(overrides=overrides)
        assert "\n" not in str(err.value)
