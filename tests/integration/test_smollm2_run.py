"""SmolLM2-135M-Instruct, the default model, trained as a user runs `raytool train`: on a local Ray
instance of its own (not the session's cluster, so this file's test runs in the suite's other
worker, beside the cluster's), a short cold-start SFT, one GRPO step, then `raytool report`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("style", ["tool_message", pytest.param("in_turn", marks=pytest.mark.slow)])
def test_smollm2_after_sft_warmup_calls_the_tool_with_masked_output(tmp_path, tokenizer, browser_page, style):
    """The default model on the real engine, a short cold-start SFT, one GRPO step: real multi-turn
    tool use, with the tool output as a tool message or inside the assistant turn (ReTool paper).
    in_turn is `slow` (80 s; `pytest -m slow`): its masks, stop strings and warm-up traces are
    tested on the real tokenizer in test_agent_loop.py, test_chat_templates.py and test_render.py."""
    run_dir = tmp_path / f"smol-{style}"
    overrides = ["trainer.sft_warmup_steps=6", "trainer.total_steps=1", "data.prompts_per_step=2", "rollout.n=2", "eval.before_train=false",
                 "eval.after_train=false", "trainer.save_final=false", "logging.trace_samples=2", "rollout.temperature=0.7",
                 f"agent.observation_style={style}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([str(Path(sys.executable).parent / "raytool"), "train", *overrides, "--run-dir", str(run_dir)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (metrics,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics["tool/calls_per_traj"] > 0
    traces = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    with_tool = [t for t in traces if t["tool_calls"] > 0 and 0 in t["response_mask"]]
    assert with_tool, "no traced trajectory called the tool"
    t = with_tool[0]
    mask, ids = t["response_mask"], t["response_ids"]
    assert len(mask) == len(ids) == len(t["rollout_logprobs"]) and mask[0] == 1 and mask[-1] == 1
    assert sum(mask) == sum(turn["tokens"] for turn in t["turns"])  # exactly the generated tokens are trained
    masked_text = tokenizer.decode([i for i, m in zip(ids, mask) if m == 0])
    outputs = [c["output"] for turn in t["turns"] for c in turn.get("calls", [])]
    assert outputs and all(out in masked_text for out in outputs)
    if style == "in_turn":
        assert [m["role"] for m in t["messages"]].count("assistant") == 1 and masked_text.startswith("\n<interpreter>\n")
    else:
        assert masked_text.startswith("\n<|im_start|>tool\n")
    # The ids decode to the conversation recorded in the trace, as the chat template renders it.
    text = tokenizer.apply_chat_template(t["messages"], tokenize=False)
    assert tokenizer.decode(t["prompt_ids"] + ids) == text[: text.rfind("<|im_end|>") + len("<|im_end|>")]
    assert t["prompt_text"] == tokenizer.decode(t["prompt_ids"])
    # Generated tokens carry the engine's log-probs; observation tokens carry none.
    assert all(lp == 0.0 for lp, m in zip(t["rollout_logprobs"], mask) if m == 0)
    assert any(lp < 0.0 for lp, m in zip(t["rollout_logprobs"], mask) if m == 1)
    if style == "tool_message":  # `raytool report` on this finished run: the trajectory's call and output in the browser
        check_report_shows_the_call(run_dir, t, browser_page)


def check_report_shows_the_call(run_dir, t: dict, page) -> None:
    from playwright.sync_api import expect

    from raytool.report import write_report

    call = next(c for turn in t["turns"] for c in turn.get("calls", []))
    page.goto(write_report(run_dir).html.as_uri())
    page.fill("#text-filter", call["arguments"]["code"])
    page.locator(".traj", has_text=t["uid"]).click()
    detail = page.locator("#traj-detail")
    expect(detail.locator("pre.code").first).to_have_text(call["arguments"]["code"])
    expect(detail.locator("pre.output").first).to_have_text(call["output"])
    assert page.js_errors == []
