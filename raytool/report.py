"""`raytool report RUN_DIR`: one self-contained HTML page of a run (no network: inline CSS and JS,
plots as base64 PNG, also written as PNG files next to it): the curves of metrics.jsonl and
sft_metrics.jsonl, and a browser over the trajectories of traces.jsonl.

A missing file or a malformed line is reported (file and line) on the page and in the log; the
report shows what the rest of the run directory holds."""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from raytool.data.rows import BadRow, jsonl_lines
from raytool.errors import RaytoolError
from raytool.tracking import verl_names

log = logging.getLogger(__name__)

RUN_FILES = ("config.yaml", "metrics.jsonl", "sft_metrics.jsonl")  # a run directory holds at least one of these


@dataclass
class Plot:
    """One figure: the series of `keys` (exact names) and of every name starting with one of
    `prefixes`, against the step. `panels`: one small axes per series (different scales)."""

    name: str  # the PNG file's stem
    title: str
    phase: str  # "grpo": metrics.jsonl, "sft": sft_metrics.jsonl
    keys: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    panels: bool = False
    zero_where: str | None = None  # a series is 0 on the steps that log this name but not the series (tool/errors/<kind>: logged when non-zero)


PLOTS = [
    Plot("reward", "Reward and accuracy (training batches)", "grpo", ("critic/score/mean", "acc/mean")),
    Plot("validation", "Validation accuracy (val-core)", "grpo", prefixes=("val-core/",)),
    Plot("turns_tools", "Turns and tool calls per trajectory", "grpo", ("num_turns/mean", "tool/calls_per_traj")),
    Plot("tool_errors", "Tool errors per call, by kind", "grpo", ("tool/error_rate",), ("tool/errors/",), zero_where="tool/error_rate"),
    Plot("lengths", "Lengths (tokens per trajectory)", "grpo", ("response_length/mean", "generated_tokens/mean")),
    Plot("timings", "Step timings (s)", "grpo", prefixes=("timing_s/",), exclude=("timing_s/update_weights",)),  # that one: weight_sync
    Plot("stages", "Slow stages: seconds queued and served per trajectory", "grpo", prefixes=("stage/",)),  # raytool.overload
    Plot("weight_sync", "Weight sync", "grpo", ("timing_s/update_weights", "weight_sync/bytes", "weight_sync/failed_servers"), panels=True),
    Plot("policy", "Policy update", "grpo", ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac"), panels=True),
    Plot("distill", "Distillation: the student's reverse KL to the teacher, agreement on tool-call turns, the teacher's share of time", "grpo",
         prefixes=("distill/",), panels=True),
    Plot("moe", "Mixture of experts: expert load and router replay", "grpo", prefixes=("moe/", "router/"), panels=True),
    Plot("sft", "SFT loss", "sft", ("train/loss", "val/loss")),
]

# Summary table: these names' first and last values, when the run has them.
_SUMMARY_KEYS = ["critic/score/mean", "acc/mean", "num_turns/mean", "tool/calls_per_traj", "tool/error_rate",
                 "response_length/mean", "timing_s/step", "timing_s/update_weights"]

# What the page keeps of a trace row (token ids, masks and log-probs are left out).
_TRACE_FIELDS = ["step", "uid", "group_id", "reward", "reward_extra", "ground_truth", "finish_reason", "num_turns", "tool_calls",
                 "tool_errors", "tool_error_kinds", "policy_version", "agent_name", "messages", "turns", "timings", "prompt_text",
                 "data_source"]


@dataclass
class RunData:
    grpo: list[dict] = field(default_factory=list)  # one merged row per step, by step
    sft: list[dict] = field(default_factory=list)
    traces: list[dict] = field(default_factory=list)
    config: str | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class Report:
    html: Path
    pngs: list[Path]
    problems: list[str]


def read_jsonl(path: Path, problems: list[str], what: str) -> list[tuple[int, dict]]:
    """(line number, object) of each JSON object of `path`, one a line; a missing file or a bad line
    is added to `problems`."""
    if not path.is_file():
        problems.append(f"{path}: missing, so no {what}")
        return []
    rows = []
    for number, row in jsonl_lines(path.read_text(encoding="utf-8", errors="replace")):
        if isinstance(row, BadRow):
            problems.append(f"{path}:{number}: {row}; line skipped")
        elif not isinstance(row, dict):
            problems.append(f"{path}:{number}: expected a JSON object, got {type(row).__name__}; line skipped")
        else:
            rows.append((number, row))
    return rows


def _by_step(rows: list[tuple[int, dict]], path: Path, phase: str, problems: list[str]) -> list[dict]:
    """Rows under verl's names, merged per step (a resumed run's later rows win), in step order."""
    merged: dict[int, dict] = {}
    for number, row in rows:
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            problems.append(f"{path}:{number}: expected an integer 'step', got {json.dumps(step)}; line skipped")
            continue
        merged.setdefault(step, {}).update(verl_names(row, phase))
    return [merged[s] for s in sorted(merged)]


def load_run(run_dir: Path) -> RunData:
    data = RunData()
    metrics, sft = run_dir / "metrics.jsonl", run_dir / "sft_metrics.jsonl"
    data.grpo = _by_step(read_jsonl(metrics, data.problems, "GRPO curves"), metrics, "grpo", data.problems)
    data.sft = _by_step(read_jsonl(sft, data.problems, "SFT curves"), sft, "sft", data.problems)
    def browsed(path: Path, split: str) -> list[dict]:
        return [{**{k: row[k] for k in _TRACE_FIELDS if k in row}, "split": split} for _, row in read_jsonl(path, data.problems, "trajectories to browse")]

    data.traces = browsed(run_dir / "traces.jsonl", "train")
    if (run_dir / "val_traces.jsonl").is_file():  # only runs that validate write it: its absence is no problem
        data.traces += browsed(run_dir / "val_traces.jsonl", "val")
    if (run_dir / "config.yaml").is_file():
        data.config = (run_dir / "config.yaml").read_text(errors="replace")
    return data


def _series(rows: list[dict], key: str, zero_where: str | None = None) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for row in rows:
        value = row.get(key, 0.0 if zero_where is not None and row.get(zero_where) is not None else None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            steps.append(row["step"])
            values.append(float(value) / 2**20 if key.endswith("/bytes") else float(value))
    return steps, values


def plot_keys(plot: Plot, rows: list[dict]) -> list[str]:
    present = {k for row in rows for k in row}
    keys = [k for k in plot.keys if k in present]
    keys += sorted(k for k in present if k not in keys and any(k.startswith(p) for p in plot.prefixes))
    return [k for k in keys if k not in plot.exclude]


def render_png(plot: Plot, rows: list[dict], keys: list[str]) -> bytes:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend
    from matplotlib.ticker import MaxNLocator

    n = len(keys) if plot.panels else 1
    cols = min(n, 3)
    nrows = -(-n // cols)
    size = (2.15 * cols, 2.4 * nrows) if plot.panels else (6.45, 3.1)  # two figures side by side on a laptop screen
    fig = Figure(figsize=size, dpi=100, layout="constrained")
    axes = fig.subplots(nrows, cols, squeeze=False).ravel()
    for i, key in enumerate(keys):
        ax = axes[i if plot.panels else 0]
        steps, values = _series(rows, key, plot.zero_where)
        label = key + (" (MiB)" if key.endswith("/bytes") else "")
        ax.plot(steps, values, marker="o", markersize=3, linewidth=1.4, label=label)
        if plot.panels:
            ax.set_title(label, fontsize=9)
    for ax in axes[:n]:
        ax.grid(alpha=0.3)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=8)
    for ax in axes[n:]:
        ax.set_visible(False)
    if not plot.panels:
        axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(plot.title, fontsize=11)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _summary_rows(data: RunData) -> list[tuple[str, str, str]]:
    rows = []
    for key in _SUMMARY_KEYS + sorted({k for r in data.grpo for k in r if k.startswith("val-core/")}):
        steps, values = _series(data.grpo, key)
        if values:
            rows.append((key, f"{values[0]:.4g} (step {steps[0]})", f"{values[-1]:.4g} (step {steps[-1]})"))
    for key in ("train/loss", "val/loss"):
        steps, values = _series(data.sft, key)
        if values:
            rows.append((f"SFT {key}", f"{values[0]:.4g} (step {steps[0]})", f"{values[-1]:.4g} (step {steps[-1]})"))
    return rows


def _json_for_script(value) -> str:
    """JSON that cannot end the <script> element it sits in."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def write_report(run_dir: str | Path, output: str | Path | None = None) -> Report:
    """Write report.html and one PNG per plot to `output` (default RUN_DIR/report)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RaytoolError(f"{run_dir} is not a directory (expected a run directory holding metrics.jsonl, traces.jsonl)")
    if not any((run_dir / name).is_file() for name in RUN_FILES):
        raise RaytoolError(f"{run_dir} holds no run (none of {', '.join(RUN_FILES)}): give the directory a run wrote, e.g. runs/<timestamp>")
    out = Path(output) if output else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    data = load_run(run_dir)
    figures, pngs = [], []
    for plot in PLOTS:
        rows = data.grpo if plot.phase == "grpo" else data.sft
        keys = plot_keys(plot, rows)
        if not keys:
            continue
        png = render_png(plot, rows, keys)
        path = out / f"{plot.name}.png"
        path.write_bytes(png)
        pngs.append(path)
        figures.append(f'<figure id="plot-{plot.name}"><img alt="{html.escape(plot.title)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
                       f"<figcaption>{html.escape(plot.title)} · <code>{html.escape(', '.join(keys))}</code></figcaption></figure>")
    for problem in data.problems:
        log.warning("%s", problem)
    parts = {
        "TITLE": html.escape(run_dir.resolve().name),
        "RUN_DIR": html.escape(str(run_dir.resolve())),
        "GENERATED": datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        "COUNTS": _counts(data),
        "PROBLEMS": _problems_html(data.problems),
        "SUMMARY": _summary_html(_summary_rows(data)),
        "FIGURES": "\n".join(figures) or "<p class=empty>No metrics to plot.</p>",
        "CONFIG": f"<details><summary>config.yaml</summary><pre>{html.escape(data.config)}</pre></details>" if data.config else "",
        "STYLE": _STYLE,
        "SCRIPT": _SCRIPT,
        "TRACES": _json_for_script(data.traces),
    }
    page = re.sub(r"__([A-Z_]+)__", lambda m: parts[m.group(1)], _PAGE)  # one pass: the run's own text is never rescanned
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return Report(html=path, pngs=pngs, problems=data.problems)


def _counts(data: RunData) -> str:
    grpo = [r["step"] for r in data.grpo if r["step"] > 0]  # step 0: validation before training
    return (f"{len(grpo)} GRPO steps{f' (last {grpo[-1]})' if grpo else ''} · {len(data.sft)} SFT steps · "
            f"{len(data.traces)} traced trajectories")


def _problems_html(problems: list[str]) -> str:
    if not problems:
        return ""
    items = "".join(f"<li>{html.escape(p)}</li>" for p in problems)
    return f'<section class="problems"><h2>Problems reading the run</h2><ul>{items}</ul></section>'


def _summary_html(rows: list[tuple[str, str, str]]) -> str:
    if not rows:
        return ""
    body = "".join(f"<tr><td><code>{html.escape(k)}</code></td><td>{a}</td><td>{b}</td></tr>" for k, a, b in rows)
    return f'<table class="summary"><thead><tr><th>metric</th><th>first</th><th>last</th></tr></thead><tbody>{body}</tbody></table>'


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>raytool run __TITLE__</title><style>__STYLE__</style></head>
<body>
<header><h1>raytool run <span>__TITLE__</span></h1>
<p class="meta"><code>__RUN_DIR__</code> · __COUNTS__ · report written __GENERATED__</p>
<nav><a href="#summary">Summary</a> <a href="#curves">Curves</a> <a href="#trajectories">Trajectories</a></nav></header>
__PROBLEMS__
<section id="summary"><h2>Summary</h2>__SUMMARY__ __CONFIG__</section>
<section id="curves"><h2>Curves</h2><div class="figures">__FIGURES__</div></section>
<section id="trajectories"><h2>Trajectories</h2>
<div class="controls">
  <label>step <select id="step-filter"><option value="">all</option></select></label>
  <label>show <select id="outcome-filter">
    <option value="">all</option><option value="rewarded">reward &gt; 0</option><option value="unrewarded">reward &le; 0</option>
    <option value="tools">with tool calls</option><option value="errors">with tool errors</option>
    <option value="train">training only</option><option value="val">validation only</option></select></label>
  <label>text <input id="text-filter" type="search" placeholder="in prompt, turns, tool calls"></label>
  <span id="match-count"></span>
</div>
<div class="browser"><div id="traj-list" role="listbox" aria-label="trajectories"></div>
<div id="traj-detail"><p class="empty">No trajectory selected.</p></div></div>
</section>
<script type="application/json" id="traces-data">__TRACES__</script>
<script>__SCRIPT__</script>
</body></html>
"""

_STYLE = """
:root { --fg:#1d2330; --muted:#5d6675; --line:#d9dee7; --bg:#f6f7f9; --ok:#1a7f37; --bad:#c62828; --accent:#2f5fb3; }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 1400px; padding: 16px 24px 48px; font: 14px/1.45 system-ui, sans-serif; color: var(--fg); background: #fff; }
h1 { font-size: 22px; margin: 8px 0 2px; } h1 span { color: var(--accent); } h2 { font-size: 17px; margin: 26px 0 10px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
.meta { color: var(--muted); margin: 0; } nav { margin-top: 6px; } nav a { color: var(--accent); margin-right: 14px; } code, pre { font: 12.5px/1.4 ui-monospace, monospace; }
.problems { background: #fff4e5; border: 1px solid #f0b35a; border-radius: 6px; padding: 4px 14px; }
.problems h2 { border: 0; margin: 8px 0 4px; font-size: 15px; } .problems li { font-family: ui-monospace, monospace; font-size: 12.5px; }
table.summary { border-collapse: collapse; } .summary td, .summary th { border-bottom: 1px solid var(--line); padding: 3px 14px 3px 0; text-align: left; }
details { margin: 10px 0; } details pre { background: var(--bg); padding: 8px; max-height: 360px; overflow: auto; }
.figures { display: flex; flex-wrap: wrap; gap: 14px; } figure { margin: 0; border: 1px solid var(--line); border-radius: 6px; padding: 6px; max-width: 100%; }
figure img { display: block; max-width: 100%; }
figcaption { font-size: 12px; color: var(--muted); margin-top: 4px; width: 0; min-width: 100%; overflow-wrap: anywhere; }  /* as wide as the plot, never wider */
.controls { display: flex; flex-wrap: wrap; gap: 16px; align-items: center; margin-bottom: 10px; }
.controls input { width: 260px; } #match-count { color: var(--muted); }
.browser { display: grid; grid-template-columns: minmax(280px, 360px) 1fr; gap: 14px; align-items: start; }
#traj-list { border: 1px solid var(--line); border-radius: 6px; max-height: 80vh; overflow: auto; }
.traj { display: grid; grid-template-columns: 1fr auto; width: 100%; text-align: left; border: 0; border-bottom: 1px solid var(--line);
        background: #fff; padding: 6px 10px; cursor: pointer; font: inherit; color: inherit; }
.traj:hover { background: var(--bg); } .traj.selected { background: #e6eefb; box-shadow: inset 3px 0 0 var(--accent); }
.traj .uid { font-family: ui-monospace, monospace; font-size: 12px; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.traj .facts { grid-column: 1 / 3; color: var(--muted); font-size: 12px; }
.reward { font-weight: 600; } .reward.pos { color: var(--ok); } .reward.neg { color: var(--bad); }
#traj-detail { border: 1px solid var(--line); border-radius: 6px; padding: 10px 14px; min-height: 200px; }
#traj-detail h3 { margin: 4px 0 8px; font-size: 16px; } #traj-detail h4 { margin: 14px 0 6px; font-size: 14px; }
.facts-table td { padding: 1px 14px 1px 0; vertical-align: top; } .facts-table td:first-child { color: var(--muted); }
.msg, .turn { border: 1px solid var(--line); border-radius: 6px; margin: 8px 0; overflow: hidden; }
.msg .role, .turn .head { background: var(--bg); padding: 3px 10px; font-size: 12px; color: var(--muted); }
pre.text { margin: 0; padding: 8px 10px; white-space: pre-wrap; word-break: break-word; }
.call { margin: 6px 10px 10px; border-left: 3px solid var(--accent); padding-left: 10px; }
.call.failed { border-left-color: var(--bad); } .call .head { font-size: 12.5px; padding: 2px 0; background: none; color: var(--fg); }
.badge { display: inline-block; border-radius: 10px; padding: 0 8px; font-size: 11.5px; color: #fff; background: var(--ok); margin-left: 6px; }
.badge.bad { background: var(--bad); }
pre.code { background: #f3f5fa; padding: 6px 8px; margin: 4px 0; white-space: pre-wrap; word-break: break-word; }
pre.output { background: #fbfbf3; padding: 6px 8px; margin: 4px 0; white-space: pre-wrap; word-break: break-word; }
.label { font-size: 11.5px; color: var(--muted); } .empty { color: var(--muted); }
"""

_SCRIPT = r"""
"use strict";
const TRACES = JSON.parse(document.getElementById("traces-data").textContent);
const stepFilter = document.getElementById("step-filter");
const outcomeFilter = document.getElementById("outcome-filter");
const textFilter = document.getElementById("text-filter");
const list = document.getElementById("traj-list");
const detail = document.getElementById("traj-detail");
let selected = null;

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}
function fmt(x) { return typeof x === "number" ? (Number.isInteger(x) ? String(x) : x.toFixed(3)) : String(x ?? ""); }
function callCode(call) {
  const args = call.arguments;
  if (args && typeof args.code === "string") return args.code;
  return args === undefined ? "" : JSON.stringify(args, null, 2);
}
function searchText(t) {
  if (t._text === undefined) {
    const parts = [t.uid, t.prompt_text, t.ground_truth];
    for (const m of t.messages || []) parts.push(m.content);
    for (const turn of t.turns || []) for (const c of turn.calls || []) parts.push(callCode(c), c.output);
    t._text = parts.filter(Boolean).join("\n").toLowerCase();
  }
  return t._text;
}
function matches(t) {
  if (stepFilter.value !== "" && String(t.step) !== stepFilter.value) return false;
  const r = t.reward ?? 0, o = outcomeFilter.value;
  if (o === "rewarded" && !(r > 0)) return false;
  if (o === "unrewarded" && r > 0) return false;
  if (o === "tools" && !(t.tool_calls > 0)) return false;
  if (o === "errors" && !(t.tool_errors > 0)) return false;
  if ((o === "train" || o === "val") && t.split !== o) return false;
  const q = textFilter.value.trim().toLowerCase();
  return !q || searchText(t).includes(q);
}
function renderList() {
  list.replaceChildren();
  let shown = 0, first = null;
  TRACES.forEach((t, i) => {
    if (!matches(t)) return;
    shown += 1;
    if (first === null) first = i;
    const b = el("button", "traj" + (i === selected ? " selected" : ""));
    b.type = "button"; b.dataset.index = i; b.setAttribute("role", "option");
    const where = t.split === "val" ? "validation · " + (t.data_source || "?") + " · " : "";
    b.append(el("span", "uid", "step " + t.step + " · " + where + (t.uid || "#" + i)));
    const r = t.reward ?? 0;
    b.append(el("span", "reward " + (r > 0 ? "pos" : "neg"), "reward " + fmt(r)));
    b.append(el("span", "facts", "turns " + (t.num_turns ?? "?") + " · calls " + (t.tool_calls ?? 0) + " · errors " +
                                 (t.tool_errors ?? 0) + " · " + (t.finish_reason || "?")));
    b.addEventListener("click", () => select(i));
    list.append(b);
  });
  document.getElementById("match-count").textContent = shown + " of " + TRACES.length + " trajectories";
  if (!shown) list.append(el("p", "empty", TRACES.length ? "No trajectory matches the filters." : "traces.jsonl holds no trajectories."));
  if ((selected === null || !matches(TRACES[selected])) && first !== null) select(first);
}
function select(i) {
  selected = i;
  for (const b of list.querySelectorAll(".traj")) b.classList.toggle("selected", Number(b.dataset.index) === i);
  renderDetail(TRACES[i]);
}
function factsTable(rows) {
  const table = el("table", "facts-table");
  for (const [k, v] of rows) {
    if (v === undefined || v === null || v === "") continue;
    const tr = el("tr"); tr.append(el("td", "", k), el("td", "", v)); table.append(tr);
  }
  return table;
}
function renderCall(call, n) {
  const box = el("div", "call" + (call.ok === false ? " failed" : ""));
  const head = el("div", "head", "tool call " + n + ": " + (call.name || "?"));
  const status = call.ok === false ? (call.kind || call.status || "error") : (call.status || "ok");
  head.append(el("span", "badge" + (call.ok === false ? " bad" : ""), status));
  if (typeof call.duration_s === "number") head.append(el("span", "label", "  " + call.duration_s.toFixed(3) + " s"));
  if (call.truncated) head.append(el("span", "label", "  (output truncated)"));
  box.append(head, el("div", "label", "code"), el("pre", "code", callCode(call)), el("div", "label", "output"), el("pre", "output", call.output ?? ""));
  return box;
}
function renderDetail(t) {
  detail.replaceChildren();
  detail.append(el("h3", "", (t.split === "val" ? "Validation trajectory " : "Trajectory ") + (t.uid || "") + " (step " + t.step + ")"));
  const kinds = Object.entries(t.tool_error_kinds || {}).map(([k, v]) => k + " " + v).join(", ");
  detail.append(factsTable([["reward", fmt(t.reward)], ["ground truth", t.ground_truth], ["finish", t.finish_reason],
    ["turns", t.num_turns], ["tool calls", t.tool_calls], ["tool errors", (t.tool_errors ?? 0) + (kinds ? " (" + kinds + ")" : "")],
    ["reward extra", t.reward_extra && Object.keys(t.reward_extra).length ? JSON.stringify(t.reward_extra) : ""],
    ["policy version", t.policy_version], ["agent", t.agent_name], ["group", t.group_id], ["data source", t.data_source],
    ["time", t.timings && t.timings.total_s !== undefined ? fmt(t.timings.total_s) + " s" : ""]]));
  const messages = t.messages || [];
  const firstAssistant = messages.findIndex(m => m.role === "assistant");
  const prompt = firstAssistant < 0 ? messages : messages.slice(0, firstAssistant);
  detail.append(el("h4", "", "Prompt"));
  for (const m of prompt) {
    const box = el("div", "msg"); box.append(el("div", "role", m.role), el("pre", "text", m.content)); detail.append(box);
  }
  if (t.prompt_text) {
    const d = el("details"); d.append(el("summary", "", "prompt as the model saw it (chat template)"), el("pre", "text", t.prompt_text)); detail.append(d);
  }
  detail.append(el("h4", "", "Turns"));
  const turns = t.turns || [];
  turns.forEach((turn, k) => {
    const box = el("div", "turn");
    const facts = ["turn " + (k + 1), (turn.tokens ?? "?") + " tokens", "finish " + (turn.finish || "?")];
    if (typeof turn.generate_s === "number") facts.push("generated in " + turn.generate_s.toFixed(2) + " s");
    if (turn.observation_dropped) facts.push("tool output did not fit the budget");
    box.append(el("div", "head", facts.join(" · ")), el("pre", "text assistant", turn.text ?? ""));
    (turn.calls || []).forEach((c, j) => box.append(renderCall(c, j + 1)));
    detail.append(box);
  });
  if (!turns.length) {  // no per-turn trace: show the conversation after the prompt
    for (const m of messages.slice(prompt.length)) {
      const box = el("div", "msg"); box.append(el("div", "role", m.role), el("pre", "text", m.content)); detail.append(box);
    }
  }
}
const steps = [...new Set(TRACES.map(t => t.step))].sort((a, b) => a - b);
for (const s of steps) { const o = el("option", "", "step " + s); o.value = String(s); stepFilter.append(o); }
for (const input of [stepFilter, outcomeFilter]) input.addEventListener("change", renderList);
textFilter.addEventListener("input", renderList);
renderList();
"""
