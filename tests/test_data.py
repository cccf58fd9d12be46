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
