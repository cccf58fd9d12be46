"""The reference recipes' configs (examples/): each loads, validates, implies the sandbox its recipe
uses, and reads data that `raytool preprocess` wrote from the source data sets' schemas."""

from pathlib import Path

import pytest

from raytool.resolve import with_tool_sandbox_settings
from raytool.config import load_config
from raytool.data.conversations import load_conversations
from raytool.data.preprocess import preprocess
from raytool.data.task import load_task
from raytool.rewards import make_reward_fn

REPO = Path(__file__).resolve().parents[1]
SOURCES = REPO / "tests" / "fixtures" / "sources"
RECIPES = ["retool_qwen3_4b_dapo_ags", "retool_qwen2.5_32b_sandbox_fusion", "retool_qwen3_4b_ascend", "gsm8k_lora_qwen2.5_1.5b"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """data/ as each recipe's header comment says to prepare it, from the fixtures."""
    root = tmp_path_factory.mktemp("recipes")
    for name, source, out in [
        ("dapo_math_17k", "dapo_math_17k.parquet", "dapo_math_17k.parquet"), ("aime_2024", "aime_2024.jsonl", "aime_2024.parquet"),
        ("aime_2025", "aime_2025.parquet", "aime_2025.parquet"), ("retool_sft", "retool_sft.parquet", "retool_sft.parquet"),
        ("gsm8k", "gsm8k.jsonl", "gsm8k_train.parquet"), ("gsm8k", "gsm8k_hf", "gsm8k_test.parquet"),
        ("gsm8k_sft", "gsm8k.jsonl", "gsm8k_sft.parquet"),
    ]:
        preprocess(name, SOURCES / source, root / "data" / out)
    (root / "examples").symlink_to(REPO / "examples")
    return root


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_loads_with_its_data_tools_and_reward(recipe, data_dir, monkeypatch):
    monkeypatch.chdir(data_dir)
    cfg = load_config(f"examples/{recipe}.yaml")
    cfg = with_tool_sandbox_settings(cfg)
    task = load_task(cfg)
    assert task.train and task.val
    assert {r.data_source for r in task.val} <= {"aime_2024", "aime_2025", "gsm8k"}
    for path in cfg.sft.train_files:
        assert load_conversations(path)[0]
    make_reward_fn(cfg.reward)  # a registered fn with valid options
    assert cfg.model.path.startswith("/models/")  # a local checkpoint: nothing is downloaded at run time


def test_ags_recipe_matches_the_reference_knobs(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = with_tool_sandbox_settings(load_config("examples/retool_qwen3_4b_dapo_ags.yaml"))
    assert (cfg.model.path, cfg.agent.format, cfg.agent.max_turns, cfg.rollout.n) == ("/models/Qwen3-4B-Instruct-2507", "hermes", 8, 8)
    a = cfg.algorithm
    assert (a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c, a.kl_loss_coef, a.kl_reward_coef) == (0.2, 0.28, 10.0, 0.0, 0.0)
    assert cfg.trainer.lr == 1e-6 and cfg.data.prompts_per_step == 128 and cfg.data.prompts_per_step // a.mini_batches == 32
    assert (cfg.eval.n, cfg.eval.temperature, cfg.eval.top_p, cfg.eval.before_train, cfg.eval.every) == (30, 1.0, 0.6, True, 5)
    assert (cfg.sandbox.backend, cfg.sandbox.e2b_domain, cfg.sandbox.e2b_template) == ("e2b", "ap-shanghai.tencentags.com", "code-interpreter-v1")
    assert cfg.sandbox.timeout_s == 30  # the tool file's default_timeout
    assert cfg.sandbox.e2b_sandbox_timeout_s >= cfg.agent.max_trajectory_s  # a trajectory's sandbox outlives it (300 s in the tool file)


def test_32b_recipe_uses_sandbox_fusion_on_4_nodes_of_8_gpus(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = with_tool_sandbox_settings(load_config("examples/retool_qwen2.5_32b_sandbox_fusion.yaml"))
    r, t = cfg.rollout, cfg.trainer
    assert r.num_servers * r.num_gpus + t.num_workers * t.num_gpus == 32 and r.tensor_parallel_size == 4
    s = cfg.sandbox  # 128 cells in flight against the service in all, as the reference ran it (max_concurrency is per pool)
    assert (s.backend, s.max_concurrency * s.num_pools, s.timeout_s, s.memory_mb) == ("sandbox_fusion", 128, 30, 1024)
    assert (cfg.data.prompts_per_step, r.n, cfg.sft.max_length, cfg.sft.batch_size, cfg.sft.epochs) == (512, 16, 16384, 32, 6)


def test_ascend_recipe_encourages_tool_calls_and_samples_dynamically(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config("examples/retool_qwen3_4b_ascend.yaml")
    assert cfg.reward.fn == "retool" and cfg.reward.tool_call_bonus > 0 and cfg.algorithm.dynamic_sampling
    assert cfg.eval.n == 30 and cfg.data.val_files == ["data/aime_2025.parquet"]
    from raytool.placement import demands, shortfall

    two_nodes = [{"CPU": 192.0, "NPU": 16.0}, {"CPU": 192.0, "NPU": 16.0}]  # 8 servers + 8 trainer workers, one NPU each
    assert cfg.cluster.accelerator == "NPU" and shortfall(demands(cfg), two_nodes) is None
    fn = make_reward_fn(cfg.reward)
    view = {"response": "\\boxed{3}", "turns": [], "num_turns": 5, "tool_calls": 2, "tool_errors": 0, "finish_reason": "stop",
            "response_tokens": 100, "max_response_tokens": cfg.agent.max_response_tokens}
    wrong_with_calls, _ = fn(view, "4", {"data_source": "aime_2025"})
    wrong_without, _ = fn({**view, "tool_calls": 0}, "4", {"data_source": "aime_2025"})
    correct, metrics = fn(view, "3", {"data_source": "aime_2025"})
    assert wrong_without == -1.0 < wrong_with_calls < correct == 1.0 and metrics["acc"] == 1.0


def test_gsm8k_recipe_trains_lora_on_one_gpu(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config("examples/gsm8k_lora_qwen2.5_1.5b.yaml")
    assert cfg.trainer.lora_rank > 0 and cfg.trainer.num_workers == 1
    assert cfg.trainer.num_gpus + cfg.rollout.num_gpus <= 1
    assert cfg.trainer.sft_warmup_steps > 0 and cfg.sft.train_files == ["data/gsm8k_sft.parquet"]
