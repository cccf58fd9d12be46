"""Shared prefixes trained once (trainer.prefix_sharing): each GRPO group's samples as one trie per
row give the same log-probs, entropies, losses and gradients as one row per sample, from fewer
tokens. The trajectories are the real chat template's tokens (Qwen2.5-Instruct's, SmolLM2's
tokenizer), with masked tool observations; no Ray."""

import pytest
import torch

from raytool.config import ConfigError, load_config
from raytool.training import Trainer
from raytool.training.batching import layout, prefix_tree, shared_prefix_units, tree_size
from raytool.training.trainer import _Seq
from raytool.types import Message, TrainBatch, Trajectory

SYSTEM = Message(role="system", content="Solve the problem. You may write Python in a ```python block; its output comes back to you.")


def _trajectory(qwen, question: str, group: str, turns: list[str], reward: float) -> Trajectory:
    """A multi-turn trajectory as the agent loop records it: each assistant turn (mask 1, the
    engine's tokens), and after all but the last the tool's output (mask 0)."""
    history = [SYSTEM, Message(role="user", content=question)]
    prompt = qwen.prompt_ids(history)
    ids, mask = [], []
    for k, text in enumerate(turns):
        turn = qwen.assistant_ids(text)
        ids += turn
        mask += [1] * len(turn)
        history.append(Message(role="assistant", content=text))
        if k < len(turns) - 1:
            tool = Message(role="tool", content=f"{len(text) % 7}\n")
            observation = qwen.observation_ids([tool], history)
            ids += observation
            mask += [0] * len(observation)
            history.append(tool)
    return Trajectory(uid=f"{group}/{len(turns)}/{reward}", group_id=group, prompt_ids=prompt, response_ids=ids, response_mask=mask,
                      rollout_logprobs=[-0.5 * m for m in mask], messages=history, ground_truth="", reward=reward)


CASES = {
    "single-turn groups": [("What is 6 * 7?", "g", [["42. \\boxed{42}"], ["6 * 7 = 42, so \\boxed{42}"], ["\\boxed{41}"]], [1.0, 1.0, 0.0]),
                           ("What is 2 + 3?", "h", [["\\boxed{5}"], ["It is 6. \\boxed{6}"]], [1.0, 0.0])],
    # The samples agree on their first turn and its tool output, then part: the trie shares more than the prompt.
    "multi-turn, shared later turns": [("Sum 1..10?", "g", [["```python\nprint(sum(range(11)))\n```", "\\boxed{55}"],
                                                            ["```python\nprint(sum(range(11)))\n```", "So \\boxed{56}"],
                                                            ["```python\nprint(55)\n```", "\\boxed{55}"]], [1.0, 0.0, 1.0])],
    "nothing shared beyond the prompt": [("Name a prime above 10.", "g", [["\\boxed{11}"], ["Thirteen: \\boxed{13}"], ["```python\nprint(17)\n```", "\\boxed{17}"]],
                                          [1.0, 1.0, 0.5])],
    "one-sample groups": [("What is 9 - 4?", "g", [["\\boxed{5}"]], [1.0]), ("What is 9 - 5?", "h", [["\\boxed{3}"]], [0.0]),
                          ("What is 1 + 1?", "k", [["\\boxed{2}"]], [1.0])],
}


def _batch(qwen, case: str) -> list[Trajectory]:
    return [_trajectory(qwen, q, g, turns, r) for q, g, samples, rewards in CASES[case] for turns, r in zip(samples, rewards)]


def _step(model_path: str, batch: list[Trajectory], sharing: str, *overrides) -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    """One RL step -> (its metrics, every parameter's gradient, the per-token log-probs and entropies before it)."""
    trainer = Trainer(load_config(None, ["trainer.compute_dtype=float32", "algorithm.kl_loss_coef=0.01", "algorithm.entropy_coeff=0.01",
                                         f"trainer.prefix_sharing={sharing}", *overrides]), model_path)
    whole = TrainBatch.whole(batch)
    seqs = [_Seq(ids=x.ids, mask=x.mask, group=g) for x, g in zip(whole.sequences, whole.groups)]
    with torch.no_grad():
        logp, entropy = trainer._logprobs(trainer.policy, seqs, temperature=1.0, with_entropy=True)
    grads, step = {}, trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.lm.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    return trainer.rl_step(whole), grads, logp, entropy


@pytest.mark.parametrize("case", list(CASES))
def test_shared_prefixes_give_the_unshared_log_probs_losses_and_gradients(tiny_model_path, qwen, case):
    batch = _batch(qwen, case)
    plain_metrics, plain_grads, plain_logp, plain_entropy = _step(tiny_model_path, batch, "false")
    tree_metrics, tree_grads, tree_logp, tree_entropy = _step(tiny_model_path, batch, "true")
    assert torch.allclose(tree_logp, plain_logp, atol=1e-5) and torch.allclose(tree_entropy, plain_entropy, atol=1e-4)
    for name in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert tree_metrics[name] == pytest.approx(plain_metrics[name], rel=1e-5, abs=1e-6), name
    assert plain_grads.keys() == tree_grads.keys() and len(plain_grads) > 10
    for name, g in plain_grads.items():
        assert torch.allclose(tree_grads[name], g, rtol=1e-4, atol=1e-6), name
    shared = sum(tree_size([t.prompt_ids + t.response_ids for t in batch if t.group_id == g]) for g in {t.group_id for t in batch})
    if case != "one-sample groups":
        assert shared < sum(len(t.prompt_ids) + len(t.response_ids) for t in batch)


@pytest.mark.parametrize("overrides", [["trainer.lora_rank=4"], ["trainer.activation_checkpointing=true"], ["trainer.micro_batch_tokens=160"]],
                         ids=["lora", "activation-checkpointing", "trees-split-by-the-budget"])
def test_shared_prefixes_compose_with_lora_activation_checkpointing_and_the_token_budget(tiny_model_path, qwen, overrides):
    batch = _batch(qwen, "multi-turn, shared later turns")
    plain_metrics, plain_grads, plain_logp, _ = _step(tiny_model_path, batch, "false", *overrides)
    tree_metrics, tree_grads, tree_logp, _ = _step(tiny_model_path, batch, "true", *overrides)
    assert torch.allclose(tree_logp, plain_logp, atol=1e-5)
    assert tree_metrics["actor/pg_loss"] == pytest.approx(plain_metrics["actor/pg_loss"], rel=1e-5, abs=1e-6)
    assert plain_grads.keys() == tree_grads.keys() and plain_grads
    for name, g in plain_grads.items():
        assert torch.allclose(tree_grads[name], g, rtol=1e-4, atol=1e-6), name
    assert tree_metrics["perf/update_row_tokens"] < plain_metrics["perf/update_row_tokens"]


def test_a_group_shares_its_prompt_once_and_every_later_turn_its_samples_agree_on(qwen):
    batch = _batch(qwen, "multi-turn, shared later turns")
    seqs = [t.prompt_ids + t.response_ids for t in batch]
    tokens, parents, paths = prefix_tree(seqs)
    first_turn = len(batch[0].prompt_ids) + len(qwen.assistant_ids("```python\nprint(sum(range(11)))\n```"))
    assert paths[0][:first_turn] == paths[1][:first_turn]  # the first two agree on their first turn: one copy
    assert paths[0][first_turn + 2] == paths[1][first_turn + 2]  # and on the tool's output after it
    assert paths[2][: len(batch[2].prompt_ids)] == paths[0][: len(batch[0].prompt_ids)] != paths[2][: first_turn]
    assert len(tokens) == tree_size(seqs) < sum(map(len, seqs))
    assert [tokens[p] for p in paths[2]] == seqs[2] and all(parents[p] == (q if q is not None else -1)
                                                            for path in paths for q, p in zip([None] + path, path))


def test_a_tree_row_lets_each_token_see_its_own_prefix_alone():
    seqs = [[1, 2, 3, 4], [1, 2, 5], [7]]
    lay = layout(seqs, [[1, 2], [1], []], pad_id=0, packed=False, device="cpu", trees=[[0, 1], [2]])
    # row 0: 1 2 3 4 5 (5's parent is 2); row 1: 7 and pads
    assert lay.input_ids.tolist() == [[1, 2, 3, 4, 5], [7, 0, 0, 0, 0]]
    assert lay.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 0, 0, 0, 0]]
    assert lay.attention_mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]
    assert lay.attention_mask[1, 0].int().tolist() == torch.eye(5, dtype=torch.int).tolist()  # a pad sees only itself
    assert sorted(zip(lay.rows.tolist(), lay.cols.tolist(), lay.select.tolist(), lay.labels.tolist())) == [
        (0, 1, 1, 3), (0, 2, 2, 4), (1, 1, 1, 5)]  # sample 1 predicts its 5 from the shared 2


def test_micro_batches_hold_trees_within_the_token_budget():
    seqs = [[1] * 30 + [2, 3], [1] * 30 + [4, 5, 6], [1] * 30 + [7], [9] * 20, [8] * 25]
    assert tree_size(seqs[:3]) == 36 and tree_size(seqs[:2]) == 35
    units = shared_prefix_units(seqs, [0, 0, 0, None, None], max_tokens=35)
    assert sorted(map(sorted, units)) == [[0, 1], [2], [3], [4]]  # the group's tree is 36 tokens: two trees; None: each alone
    assert shared_prefix_units(seqs, [0, 0, 0, None, None], max_tokens=36)[0] == [0, 1, 2]


@pytest.mark.parametrize("setting, why", [
    (["trainer.packing=true"], "packed sequences"),
    (["trainer.sequence_parallel_size=2", "trainer.num_workers=2"], "sequence parallelism"),
    (["trainer.router_replay=r2"], "trainer.router_replay=r2"),
])
def test_prefix_sharing_true_where_it_cannot_run_is_refused_naming_the_key(setting, why):
    with pytest.raises(ConfigError, match=rf"config key 'trainer.prefix_sharing' is true, but .*{why}"):
        load_config(None, ["trainer.prefix_sharing=true", *setting])
    load_config(None, setting)  # auto: off there, silently (it cannot save anything)


def test_auto_shares_only_where_the_trees_hold_fewer_tokens(tiny_model_path):
    trainer = Trainer(load_config(None, []), tiny_model_path)
    assert trainer.prefix_sharing == "saving"
    apart = [_Seq(ids=[1, 2, 3], mask=[1, 1], group=0), _Seq(ids=[4, 5, 6], mask=[1, 1], group=0)]
    together = [_Seq(ids=[1, 2, 3, 4], mask=[0, 1, 1], group=0), _Seq(ids=[1, 2, 3, 5], mask=[0, 1, 1], group=0)]
    assert trainer._trees(apart) is None and trainer._trees(together) == [[0, 1]]


def test_the_trainer_bench_times_shared_against_unshared_rows_and_counts_their_tokens(tiny_model_path, qwen):
    from raytool.bench.trainer import _sharing_vs_unshared

    trainer = Trainer(load_config(None, ["trainer.compute_dtype=float32"]), tiny_model_path)
    batch = TrainBatch.whole(_batch(qwen, "single-turn groups"))
    modes = []
    result, rows = _sharing_vs_unshared(trainer, batch, lambda run: (run(), modes.append(trainer.prefix_sharing), 1.0 if modes[-1] else 2.0)[2], 2)
    assert modes == ["", "saving", "", "saving"] and trainer.prefix_sharing == "saving"  # alternating, left as configured
    assert result["sharing_vs_unshared"] == 2.0 and result["row_tokens_shared_vs_unshared"] < 0.6
    longest = max(len(x.ids) for x in batch.sequences)  # one micro-batch (4,096 tokens): every sequence padded to the longest
    assert result["unshared_row_tokens_per_step"] == len(batch.sequences) * longest
    assert result["row_tokens_per_step"] == 2 * max(tree_size([x.ids for x in g]) for g in _rows_by_group(batch))  # a tree per group
    assert "sharing_vs_unshared = 2.00" in rows[0]


def _rows_by_group(batch: TrainBatch) -> list[list]:
    groups: dict = {}
    for x, g in zip(batch.sequences, batch.groups):
        groups.setdefault(g, []).append(x)
    return list(groups.values())
