from raytool.data import PromptLoader, make_splits
from raytool.data.tool_arith import sft_messages


def test_splits_are_deterministic_and_disjoint():
    train_a, val_a = make_splits(200, 40, seed=3)
    train_b, val_b = make_splits(200, 40, seed=3)
    assert train_a == train_b and val_a == val_b
    assert not {p.question for p in train_a} & {p.question for p in val_a}
    assert make_splits(200, 40, seed=4)[0] != train_a


def test_answers_are_exact_integers_matching_their_code():
    train, _ = make_splits(50, 5, seed=0)
    kinds = {p.kind for p in train}
    assert kinds == {"product", "range_sum", "power_mod", "square_sum", "multiple_count"}
    for p in train:
        int(p.answer)
        if p.kind == "product":
            a, b = p.question.removeprefix("What is ").removesuffix("?").split(" * ")
            assert int(p.answer) == int(a) * int(b)


def test_sft_trace_shape():
    problem = make_splits(5, 1, seed=0)[0][0]
    roles = [m.role for m in sft_messages(problem)]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    msgs = sft_messages(problem)
    assert problem.code in msgs[2].content and msgs[3].content == problem.answer
    assert f"\\boxed{{{problem.answer}}}" in msgs[4].content


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
