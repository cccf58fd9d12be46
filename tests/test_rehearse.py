"""`raytool rehearse`'s decisions without Ray: what it swaps in each recipe, how far it scales a
topology down on a small host, the stages' command lines, and how it judges what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from raytool import rehearse as rh
from raytool.config import load_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
ROOMY = rh.Host(cores=64, memory_gib=512.0)  # a host where nothing needs scaling
DEV = rh.Host(cores=2, memory_gib=21.0)  # the development machine


def plan(recipe: str, host: rh.Host = ROOMY, tmp: Path = Path("/shared-test"), overrides=(), conversations: int = 3) -> rh.Rehearsal:
    path = EXAMPLES / recipe
    cfg = load_config(str(path), list(overrides))
    return rh.plan_rehearsal(str(path), cfg, rh.recipe_keys(path), host, tmp, "http://127.0.0.1:9999/run_code", conversations, extra=list(overrides))


def swaps(r: rh.Rehearsal) -> dict[str, str]:
    return {o.key: o.value for o in r.overrides}


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)  # the recipes' tool YAMLs are relative to the checkout


def test_the_32b_recipe_keeps_its_four_nodes_and_sixteen_ranks_where_the_host_allows(tmp_path):
    r = plan("retool_qwen2.5_32b_sandbox_fusion.yaml", tmp=tmp_path, overrides=["trainer.cpu_offload=true"])
    assert [(n.name, n.head, n.accelerators) for n in r.nodes] == [("node-0", True, {"GPU": 8.0})] + [(f"node-{i}", False, {"GPU": 8.0}) for i in (1, 2, 3)]
    assert r.scaled == [] and "trainer.num_workers" not in swaps(r) and "rollout.num_servers" not in swaps(r)
    s = swaps(r)
    assert s["rollout.engine"] == "hf" and s["trainer.cpu_offload"] == "false" and s["trainer.total_steps"] == "2"
    assert any("CPU offload" in line for line in r.cannot)
    assert s["model.path"] == str(tmp_path / "models" / "tiny-qwen2-Qwen2.5-32B-Instruct") and r.family == "qwen2"
    assert s["trainer.checkpoint_dir"] == str(tmp_path / "checkpoints")
    assert s["sandbox.fusion_url"] == "http://127.0.0.1:9999/run_code"
    assert s["data.train_files"] == f"[{tmp_path / 'data' / 'dapo_math_17k.parquet'}]"
    # every rank of the 16 gets a sequence: 16 ranks / n=2 -> 8 prompts; SFT batches of >= 16 conversations
    assert s["data.prompts_per_step"] == "8" and int(s["sft.batch_size"]) >= 16
    # each override names the recipe's own value
    assert next(o for o in r.overrides if o.key == "data.prompts_per_step").recipe == "512"


def test_a_small_host_scales_ranks_and_servers_down_and_says_by_how_much(tmp_path):
    r = plan("retool_qwen2.5_32b_sandbox_fusion.yaml", DEV, tmp_path)
    s = swaps(r)
    workers, servers = int(s["trainer.num_workers"]), int(s["rollout.num_servers"])
    assert workers < 16 and servers < 4 and workers + servers <= rh.HEAVY_PER_CORE * DEV.cores
    assert any(line.startswith(f"trainer.num_workers: 16 -> {workers} (") for line in r.scaled)
    assert len(r.nodes) == 4  # two raylets per core: the recipe's 4 nodes still fit
    one_core = plan("retool_qwen2.5_32b_sandbox_fusion.yaml", rh.Host(1, 21.0), tmp_path)
    assert len(one_core.nodes) == 2 and one_core.scaled[0].startswith("nodes: 4 -> 2 (0.50x)")


def test_a_one_node_recipe_gets_a_cpu_head_beside_its_npu_node_and_its_dapo_shaping_shrinks(tmp_path):
    r = plan("retool_qwen3_4b_ascend.yaml", tmp=tmp_path, overrides=["cluster.nodes=1", "cluster.gpus_per_node=16"])
    assert [(n.name, n.head, n.accelerators) for n in r.nodes] == [("head", True, {}), ("node-0", False, {"NPU": 16.0})]
    assert r.accelerator == "NPU" and r.template == "qwen3.jinja"
    s = swaps(r)
    assert int(s["reward.overlong_buffer_tokens"]) < int(s["agent.max_response_tokens"])
    assert any("HCCL collectives" in line for line in r.cannot) and any("NPU kernels" in line for line in r.cannot)


def test_the_e2b_recipe_runs_its_tool_on_the_local_server_and_says_so(tmp_path):
    r = plan("retool_qwen3_4b_dapo_ags.yaml", tmp=tmp_path)
    tools = Path(swaps(r)["agent.tools"])
    assert "cannot reach" in r.sandbox and any("E2B" in line for line in r.cannot)
    (tool,) = yaml.safe_load(tools.read_text())["tools"]
    assert tool["config"]["sandbox_fusion_url"] == "http://127.0.0.1:9999/run_code" and not any(k.startswith("e2b") for k in tool["config"])
    assert tool["tool_schema"]["function"]["name"] == "code_interpreter"  # the recipe's schema kept
    assert r.template == "qwen3_instruct_2507.jinja"
    # no SFT stage of its own: GRPO, then the resume
    assert [s.name for s in r.stages] == ["grpo", "resume"] and r.export == ""


def test_stages_hand_the_sft_export_to_grpo_and_resume_from_the_step_1_checkpoint(tmp_path):
    r = plan("retool_qwen3_4b_ascend.yaml", tmp=tmp_path, overrides=["trainer.lr=2e-6"])
    sft, grpo, resume = r.stages
    assert (sft.command, grpo.command, resume.command) == ("sft", "train", "train")
    export = str(tmp_path / "checkpoints" / "retool_qwen3_4b_ascend-sft" / "step_2" / "hf")
    assert r.export == export and f"model.path={export}" in grpo.args and f"model.path={export}" in resume.args
    assert sum(a.startswith("model.path=") for a in grpo.args) == 1
    assert resume.args[-2:] == ["--resume", str(tmp_path / "checkpoints" / "retool_qwen3_4b_ascend-rl" / "step_1")]
    assert "--run-dir" not in resume.args  # as a user resumes
    assert sft.args[:3] == ["-c", "examples/retool_qwen3_4b_ascend.yaml", "trainer.lr=2e-6"]  # the user's override first
    assert sft.entrypoint().startswith("raytool sft -c examples/retool_qwen3_4b_ascend.yaml ")


def test_the_gsm8k_recipe_warms_up_in_run_on_one_gpu(tmp_path):
    r = plan("gsm8k_lora_qwen2.5_1.5b.yaml", tmp=tmp_path)
    s = swaps(r)
    assert [n.accelerators for n in r.nodes] == [{}, {"GPU": 1.0}]
    assert s["trainer.sft_warmup_steps"] == "2" and [st.name for st in r.stages] == ["grpo", "resume"]
    assert str(tmp_path / "runs") in r.rl_checkpoints  # no checkpoint_dir: RUN_DIR/checkpoints, on the shared storage


def test_sft_sizes_give_two_steps_and_every_rank_a_conversation():
    cfg = load_config(str(EXAMPLES / "retool_qwen2.5_32b_sandbox_fusion.yaml"), [])  # val_fraction 0.02 holds one out
    copies, overrides = rh.sft_sizes(cfg, 3, 16)
    batch = int({o.key: o.value for o in overrides}["sft.batch_size"])
    train = rh._sft_train(3 * copies, cfg.sft)
    assert train >= 2 * 16 and -(-train // batch) == rh.STEPS and batch >= 16


@pytest.mark.parametrize("raw,error", [
    ({"model": {"path": "/models/Qwen3-4B"}, "cluster": {"gpus_per_node": 8}}, "config key 'cluster.nodes' is missing"),
    ({"model": {"path": "/models/Qwen3-4B"}, "cluster": {"nodes": 1, "gpus_per_node": 0}}, "is 0"),
    ({"model": {"path": "/models/Gemma-2-9B"}, "cluster": {"nodes": 1, "gpus_per_node": 8}}, "no tiny model of its family"),
    ({"model": {"path": "/models/Qwen3-4B"}, "cluster": {"nodes": 1, "gpus_per_node": 8}, "data": {"train_files": ["data/mine.parquet"]}},
     "no fixture stands in"),
])
def test_a_recipe_that_cannot_be_rehearsed_is_one_line_naming_what_it_lacks(tmp_path, raw, error):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(rh.RehearsalError, match=error) as info:
        rh.check_rehearsable(path, raw, load_config(str(path), []))
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def seen(name, node, gpus=0.0, peak_gib=0.0):
    return rh.Seen(name, node, 1, {"GPU": gpus} if gpus else {}, int(peak_gib * rh.GiB))


def test_placement_check_counts_roles_and_accelerators_per_node():
    nodes = [rh.Node("node-0", True, {"GPU": 2.0}), rh.Node("node-1", False, {"GPU": 2.0})]
    good = [seen("trainer-0", "node-0", 1), seen("trainer-1", "node-0", 1), seen("rollout-server-0", "node-1", 2), seen("llm-manager", "node-1")]
    expected = {"trainer worker": 2, "rollout server": 1, "llm manager": 1}
    accelerators = {"trainer worker": 2.0, "rollout server": 2.0}
    ok = rh.check_placement("grpo", good, expected, nodes, accelerators, "GPU")
    assert ok.ok and "node-0: 2 trainer workers" in ok.detail
    missing = rh.check_placement("grpo", good[:1] + good[2:], expected, nodes, accelerators, "GPU")
    assert not missing.ok and "1 of 2 trainer workers placed" in missing.detail and "hold 1 GPUs, the plan counts 2" in missing.detail
    head_only = [rh.Node("head", True, {}), *nodes[1:]]
    wrong = rh.check_placement("grpo", [seen("trainer-0", "head", 1)], {"trainer worker": 1}, head_only, {"trainer worker": 1.0}, "GPU")
    assert not wrong.ok and "trainer-0 holds GPUs on head, which declares none" in wrong.detail


def test_memory_check_allows_rank_0_its_checkpoint_read_and_names_a_rank_over_the_plan():
    within = [seen("trainer-0", "n", peak_gib=1.5), seen("trainer-1", "n", peak_gib=1.0)]
    assert rh.check_trainer_memory("sft", within, 1.0 * rh.GiB, 0.5 * rh.GiB).ok
    over = within + [seen("trainer-2", "n", peak_gib=1.3)]
    check = rh.check_trainer_memory("sft", over, 1.0 * rh.GiB, 0.5 * rh.GiB)
    assert not check.ok and check.detail.endswith("over 1.2x: trainer-2")


def test_resume_check_wants_the_shared_run_continued_and_step_2_repeated(tmp_path):
    step1 = {"step": 1, "reward/mean": 0.5, "policy_version": 1, "timing/step_s": 3.0}
    step2 = {"step": 2, "reward/mean": 0.25, "policy_version": 2, "timing/step_s": 3.0, "timing_s/gen": 1.5, "train/loss": 0.125}
    logs = "resumed from /s/step_1 at step 1 (0 groups to roll out again, 0 finished groups to train)\n"
    redone = {**step2, "timing/step_s": 9.0, "timing_s/gen": 4.5}  # the pipeline's own timing names (timing_s/gen ...) too
    assert rh.check_resume(tmp_path, [step1, step2], [step1, redone], logs, True).ok
    drifted = rh.check_resume(tmp_path, [step1, step2], [step1, {**redone, "train/loss": 0.5}], logs, True)
    assert not drifted.ok and "train/loss" in drifted.detail
    elsewhere = rh.check_resume(tmp_path, [step1, step2], [step1, step2], logs + "run directory: /job/copy/runs/x\n", True)
    assert not elsewhere.ok and "wrote to /job/copy/runs/x" in elsewhere.detail


def test_json_is_one_object_with_every_check(tmp_path):
    r = plan("gsm8k_lora_qwen2.5_1.5b.yaml", tmp=tmp_path)
    checks = [rh.Check("job (grpo)", True, "30 s"), rh.Check("export read back (grpo)", None, "no SFT stage"), rh.Check("resume exact (resume)", False, "x")]
    out = json.loads(json.dumps(rh.to_json(r, checks, {"total": 60.0})))
    assert out["ok"] is False and [c["ok"] for c in out["checks"]] == [True, None, False]
    assert {o["key"] for o in out["overrides"]} >= {"model.path", "rollout.engine"} and out["not_rehearsed"]
