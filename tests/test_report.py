"""`raytool report`: the HTML page of a run written by the real Tracker, read in a headless browser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytool.cli import main
from raytool.config import LoggingConfig
from raytool.report import write_report
from raytool.tracking import Tracker
from raytool.types import Message, Trajectory

def _trajectory(uid: str, code: str, output: str, reward: float, ok: bool = True) -> Trajectory:
    """A two-turn trajectory as the agent loop traces it: a code call, its output, then the answer."""
    call = {"name": "code_interpreter", "arguments": {"code": code}, "ok": ok, "kind": None if ok else "timeout",
            "status": "ok" if ok else "timeout", "duration_s": 0.05, "truncated": False, "output": output}
    first = f"Let me compute it.\n<code>\n```python\n{code}\n```\n</code>"
    answer = "The answer is \\boxed{42}."
    return Trajectory(
        uid=uid, group_id=uid.split("-")[0], prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7], response_mask=[1, 1, 0, 1],
        rollout_logprobs=[-0.1, -0.2, 0.0, -0.3],
        messages=[Message("system", "Use the code tool."), Message("user", f"What is 6*7? ({uid})"), Message("assistant", first),
                  Message("tool", output), Message("assistant", answer)],
        ground_truth="42", reward=reward, num_turns=2, tool_calls=1, tool_errors=0 if ok else 1,
        tool_error_kinds={} if ok else {"timeout": 1}, finish_reason="answer", policy_version=1, agent_name="tool_agent",
        turns=[{"text": first, "tokens": 20, "finish": "stop", "generate_s": 0.2, "tools_s": 0.05, "calls": [call]},
               {"text": answer, "tokens": 8, "finish": "stop", "generate_s": 0.1}],
        timings={"total_s": 0.4, "generate_s": 0.3, "tools_s": 0.05},
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run of 2 SFT and 3 GRPO steps (validation at 0 and 3), two traced trajectories per step."""
    run = tmp_path_factory.mktemp("report") / "run"
    tracker = Tracker(run, LoggingConfig(logger=[]))
    for step in (1, 2):
        tracker.log({"step": step, "sft/loss": 2.0 / step, "timing/step_s": 0.2}, phase="sft")
    tracker.log({"step": 0, "val-core/tool_arith/acc/mean@4": 0.25, "timing/validation_s": 1.0})
    for step in (1, 2, 3):
        tracker.log({"step": step, "reward/mean": step / 4, "acc/mean": step / 5, "num_turns/mean": 2.0, "tool/calls_per_traj": 1.0,
                     "tool/error_rate": 0.5 if step == 2 else 0.0, **({"tool/errors/timeout": 0.5} if step == 2 else {}),
                     "response_length/mean": 50.0 + step, "actor/pg_loss": 0.1, "actor/grad_norm": 1.0,
                     "timing/step_s": 3.0, "timing/rollout_s": 2.0, "timing/train_s": 0.7, "timing/weight_sync_s": 0.3,
                     "weight_sync/bytes": 2**21, "weight_sync/failed_servers": 0, "stage/reward/queue_s": 4.0 / step, "stage/reward/service_s": 1.0,
                     **({"val-core/tool_arith/acc/mean@4": 0.5} if step == 3 else {})})
        tracker.trace(step, [_trajectory(f"s{step}-a", f"print(6 * 7)  # step {step}", "42", 1.0),
                             _trajectory(f"s{step}-b", f"while True: pass  # step {step}", "Error (timeout): the cell ran past 5 s", 0.0, ok=False)],
                      decode=lambda ids: f"<|im_start|>user decoded {ids}")
    # validation at step 3 (one trajectory of one data source), as pipeline.validate writes it
    tracker.trace(3, [_trajectory("val3g0-0", "print(2 ** 10)", "1024", 1.0)], decode=lambda ids: "decoded", data_sources=["aime_2024"])
    tracker.close()
    return run


@pytest.fixture(scope="module")
def report(run_dir):
    return write_report(run_dir, run_dir.parent / "out")


@pytest.fixture
def small_run(tmp_path) -> Path:
    """Two GRPO steps with a reward only: one curve, quick to draw."""
    tracker = Tracker(tmp_path / "small", LoggingConfig(logger=[]))
    for step in (1, 2):
        tracker.log({"step": step, "reward/mean": step / 2})
    tracker.close()
    return tmp_path / "small"


def test_report_writes_the_page_and_one_png_per_curve(report):
    assert report.problems == []
    assert {p.name for p in report.pngs} == {"reward.png", "validation.png", "turns_tools.png", "tool_errors.png", "lengths.png",
                                              "timings.png", "stages.png", "weight_sync.png", "policy.png", "sft.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in report.pngs)
    page = report.html.read_text()
    assert page.count("data:image/png;base64,") == len(report.pngs)
    assert "http://" not in page and "https://" not in page and "<link" not in page  # nothing to fetch
    assert "tool/errors/timeout" in page and "critic/score/mean" in page and "val-core/tool_arith/acc/mean@4" in page
    traces = json.loads(page.split('id="traces-data">')[1].split("</script>")[0])
    assert len(traces) == 7 and "prompt_ids" not in traces[0] and traces[1]["turns"][0]["calls"][0]["output"].startswith("Error (timeout)")
    assert [t["split"] for t in traces] == ["train"] * 6 + ["val"] and traces[6]["data_source"] == "aime_2024"
    assert "data_source" not in traces[0]


def test_missing_files_and_bad_lines_are_named_and_the_rest_is_reported(small_run, tmp_path, caplog):
    run_dir = small_run
    (run_dir / "traces.jsonl").unlink()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/mean": \n[1, 2]\n{"reward/mean": 1.0}\n')
    report = write_report(run_dir, tmp_path / "out")
    metrics = run_dir / "metrics.jsonl"
    assert report.problems[0].startswith(f"{metrics}:3: not valid JSON")
    assert report.problems[1] == f"{metrics}:4: expected a JSON object, got list; line skipped"
    assert report.problems[2] == f"{metrics}:5: expected an integer 'step', got null; line skipped"
    assert report.problems[3] == f"{run_dir / 'traces.jsonl'}: missing, so no trajectories to browse"
    assert [p.name for p in report.pngs] == ["reward.png"]
    page = report.html.read_text()
    assert "Problems reading the run" in page and "metrics.jsonl:3: not valid JSON" in page
    assert "metrics.jsonl:4" in caplog.text


def test_cli_report_prints_the_page_and_refuses_a_missing_run_dir(small_run, tmp_path, capsys):
    assert main(["report", str(small_run)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {(small_run / 'report' / 'report.html').resolve()}"
    assert (small_run / "report" / "reward.png").is_file()
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("files", [[], ["traces.jsonl", "notes.txt"]])
def test_cli_report_of_a_directory_without_a_run_is_one_line_and_writes_nothing(files, tmp_path, capsys):
    """No config.yaml, metrics.jsonl or sft_metrics.jsonl: not a run (an empty page would say nothing)."""
    folder = tmp_path / "not_a_run"
    folder.mkdir()
    for name in files:
        (folder / name).write_text("")
    assert main(["report", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"raytool: {folder} holds no run (none of config.yaml, metrics.jsonl, sft_metrics.jsonl): "
                                 "give the directory a run wrote, e.g. runs/<timestamp>\n")
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)  # no report/ folder
    assert main(["report", str(folder), "--output", str(tmp_path / "out")]) == 2 and not (tmp_path / "out").exists()


def test_trajectory_browser_in_headless_chromium_shows_the_selected_call_and_output(report, browser_page):
    from playwright.sync_api import expect

    page = browser_page
    page.goto(report.html.as_uri())
    expect(page.locator("#match-count")).to_have_text("7 of 7 trajectories")
    expect(page.locator("#traj-detail pre.code")).to_have_text("print(6 * 7)  # step 1")  # the first is shown at once

    page.select_option("#step-filter", "2")
    page.select_option("#outcome-filter", "errors")
    expect(page.locator("#match-count")).to_have_text("1 of 7 trajectories")
    page.locator(".traj", has_text="s2-b").click()
    expect(page.locator(".traj.selected")).to_contain_text("s2-b")
    detail = page.locator("#traj-detail")
    expect(detail.locator("pre.code")).to_have_text("while True: pass  # step 2")
    expect(detail.locator("pre.output")).to_have_text("Error (timeout): the cell ran past 5 s")
    expect(detail.locator(".badge.bad")).to_have_text("timeout")
    expect(detail.get_by_text("What is 6*7? (s2-b)")).to_be_visible()
    expect(detail.get_by_text("The answer is \\boxed{42}.")).to_be_visible()
    expect(detail.get_by_text("print(6 * 7)  # step 1")).to_have_count(0)

    page.select_option("#outcome-filter", "")
    page.fill("#text-filter", "print(6 * 7)  # step 3")
    expect(page.locator(".traj")).to_have_count(0)  # step 2 is still selected in the step filter
    page.select_option("#step-filter", "")
    page.locator(".traj", has_text="s3-a").click()
    expect(detail.locator("pre.output")).to_have_text("42")

    page.fill("#text-filter", "")
    page.select_option("#outcome-filter", "val")
    expect(page.locator("#match-count")).to_have_text("1 of 7 trajectories")
    expect(page.locator(".traj.selected")).to_contain_text("validation · aime_2024 · val3g0-0")
    expect(detail.locator("h3")).to_have_text("Validation trajectory val3g0-0 (step 3)")
    expect(detail.locator("pre.output")).to_have_text("1024")
    assert page.js_errors == []
