"""`autoplan report` end to end: every format, numbers equal to `plan --json`, charts present, bad input."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import pytest

from tests.report.conftest import BATCH, MODEL, SEQ

SWEEP = [MODEL, "--tokens", "100B", "--seq-len", str(SEQ), "--global-batch", str(BATCH),
         "--price", "h100=2.5", "--price", "a100-sxm4-80gb=1.25"]
CHART_IDS = {"chart-time-vs-cost", "chart-memory", "chart-step-time", "chart-pipeline"}


class _Charts(HTMLParser):
    """Collects each chart figure and the ids of the SVG elements inside it."""

    def __init__(self):
        super().__init__()
        self.figures: dict[str, set[str]] = {}
        self.svgs: dict[str, int] = {}
        self.external: list[str] = []
        self._open: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "figure" and "chart" in a.get("class", ""):
            self._open = a["id"]
            self.figures[self._open] = set()
        elif self._open:
            if tag == "svg":
                self.svgs[self._open] = self.svgs.get(self._open, 0) + 1
            if "id" in a:
                self.figures[self._open].add(a["id"])
        for key in ("src", "href", "xlink:href"):  # anything a browser would fetch
            if a.get(key) and not a[key].startswith(("#", "data:")):
                self.external.append(a[key])

    def handle_endtag(self, tag):
        if tag == "figure":
            self._open = None


@pytest.fixture(scope="module")
def planned():
    """`autoplan plan --json` for 8 x h100 (the CLI in-process, as the run_cli fixture does)."""
    from click.testing import CliRunner

    from autoplan.cli import cli

    result = CliRunner().invoke(cli, ["plan", MODEL, "--gpu", "h100", "--gpus", "8", "--global-batch", str(BATCH),
                                      "--seq-len", str(SEQ), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_agrees_with_plan_json(run_cli, planned):
    code, out, err = run_cli("report", *SWEEP, "--gpu", "h100", "--gpus", "8", "--format", "json")
    assert code == 0, err
    report = json.loads(out)
    (row,) = report["rows"]
    est = planned["estimate"]
    # the same search on the same graph: identical numbers (only float formatting could differ)
    for key in ("step_time_s", "tokens_per_s_per_gpu", "mfu", "memory_gib_per_gpu"):
        assert row[key] == pytest.approx(est[key], rel=1e-9), key
    for key in ("dp", "tp", "pp", "cp", "zero_stage", "micro_batch", "schedule"):
        assert row["config"][key] == planned["plan"][key], key
    steps = -(-10**11 // (BATCH * SEQ))
    assert row["steps"] == steps and row["training_s"] == pytest.approx(steps * est["step_time_s"])
    assert row["cost_usd"] == pytest.approx(row["gpu_hours"] * 2.5)
    assert report["detail"]["per_stage"] == est["per_stage"]
    assert report["error"]["relative"] > 0  # the stored measured error is applied
    lo, hi = row["time_range_s"]
    assert lo < row["time_to_train_s"] < hi


def test_html_has_every_chart(small_sweep, tmp_path):
    from autoplan.report import render_files as rf
    from autoplan.report.document import fastest_detail, sweep_dict

    detail = fastest_detail(small_sweep)
    html = rf.render_html(sweep_dict(small_sweep), rf.render_charts(small_sweep, detail))
    parser = _Charts()
    parser.feed(html)
    assert set(parser.figures) == CHART_IDS and not parser.external  # self-contained
    assert "@import" not in html and "url(http" not in html
    assert all(parser.svgs.get(c) == 1 for c in CHART_IDS)
    ids = set().union(*parser.figures.values())
    for r in small_sweep.rows:
        assert f"time-cost-point-{r.gpu}-{r.num_gpus}" in parser.figures["chart-time-vs-cost"]
    assert "time-cost-frontier" in parser.figures["chart-time-vs-cost"]
    assert "memory-capacity" in parser.figures["chart-memory"]
    parts = {"parameters", "gradients", "optimizer", "activations", "buffers"}
    assert all(f"memory-{p}-stage-0" in parser.figures["chart-memory"] for p in parts)
    assert any(i.startswith("step-compute-") for i in parser.figures["chart-step-time"])
    for r in range(detail.plan.pp):
        assert {f"pipeline-rank-{r}-F", f"pipeline-rank-{r}-B"} <= parser.figures["chart-pipeline"]
    assert len(ids) == sum(len(v) for v in parser.figures.values())  # no id shared between charts


def test_markdown_and_terminal_show_the_same_numbers(small_sweep, tmp_path):
    from rich.console import Console

    from autoplan.report import render_files as rf
    from autoplan.report.document import fastest_detail, sweep_dict
    from autoplan.report.formatting import usd
    from autoplan.report.render_terminal import print_report

    doc = sweep_dict(small_sweep)
    md = tmp_path / "report.md"
    written = rf.write_markdown(md, doc, rf.render_charts(small_sweep, fastest_detail(small_sweep)), force=False)
    assert {p.name for p in written[1:]} == {f"report-{c[len('chart-'):]}.svg" for c in CHART_IDS}
    text = md.read_text()
    for p in written[1:]:
        assert f"]({p.name})" in text and p.read_text().startswith("<svg")
    console = Console(record=True, width=250)
    print_report(doc, console)
    term = console.export_text()
    for row in doc["rows"]:
        assert usd(row["cost_usd"]) in text and usd(row["cost_usd"]) in term
    from autoplan.errors import UserError

    with pytest.raises(UserError, match="--force"):
        rf.write_markdown(md, doc, {"memory": "<svg/>"}, force=False)


def test_html_file_and_force(run_cli, planned, tmp_path):
    out = tmp_path / "r.html"
    out.write_text("mine")
    args = ("report", *SWEEP, "--gpu", "h100", "--gpus", "8", "-o", str(out))
    code, _, err = run_cli(*args)
    assert code == 2 and "--force" in err and out.read_text() == "mine"
    code, _, err = run_cli(*args, "--force")
    assert code == 0, err
    html = out.read_text()
    parser = _Charts()
    parser.feed(html)
    assert set(parser.figures) == CHART_IDS
    from autoplan.report.formatting import duration, pct

    est = planned["estimate"]  # the page shows the numbers `plan --json` gives for the same cluster
    row = html[html.index('data-label="8 x h100-sxm-80gb"'):]
    row = row[:row.index("</tr>")]
    assert f"<td>{duration(est['step_time_s'])}</td><td>{pct(est['mfu'])}</td>" in row
    assert f"{est['memory_gib_per_gpu']:.1f} / {80 - est['memory_gib_per_gpu']:.1f}" in row


def test_plan_file_in_depth(run_cli, tmp_path):
    plan = tmp_path / "plan.json"
    code, _, err = run_cli("plan", MODEL, "--gpu", "h100", "--gpus", "8", "--global-batch", str(BATCH),
                           "--seq-len", str(SEQ), "-o", str(plan))
    assert code == 0, err
    code, out, err = run_cli("report", "--plan", str(plan), "--tokens", "100B", "--price", "h100=2.5",
                             "--format", "json")
    assert code == 0, err
    doc = json.loads(out)
    saved = json.loads(plan.read_text())
    assert doc["kind"] == "plan" and doc["detail"]["step_time_s"] == saved["estimate"]["step_time_s"]
    assert doc["detail"]["cost_usd"] == pytest.approx(doc["detail"]["gpu_hours"] * 2.5)
    code, out, err = run_cli("report", "--plan", str(plan), "--tokens", "100B", "--price", "h100=2.5",
                             "--format", "html")
    parser = _Charts()
    parser.feed(out)
    assert set(parser.figures) == CHART_IDS - {"chart-time-vs-cost"}


@pytest.mark.parametrize("args,message", [
    (["--gpu", "h1000", "--gpus", "8"], "Unknown GPU 'h1000'"),
    (["--gpu", "h100,l40s", "--gpus", "8", "--tokens", "1T"], "--price l40s="),
    (["--gpu", "h100", "--gpus", "8", "--tokens", "0"], "--tokens"),
    (["--gpu", "h100", "--gpus", "8", "--tokens", "-2T"], "--tokens"),
    (["--gpu", "h100", "--gpus", "0"], "--gpus"),
    (["--gpu", "h100", "--gpus", "8", "--global-batch", "0"], "--global-batch"),
    (["--gpu", "h100", "--gpus", "8", "--global-batch", "-4"], "--global-batch"),
    (["--gpu", "h100", "--gpus", "8", "--budget", "-1"], "--budget"),
    (["--plan", "plan.json"], "--plan reports one plan file"),
    (["--gpu", "h100", "--gpus", "8", "-o", "report.pdf"], "cannot tell the report format"),
])
def test_bad_input_exits_2(run_cli, args, message):
    base = [MODEL, "--tokens", "1T", "--seq-len", str(SEQ), "--global-batch", str(BATCH)]
    code, out, err = run_cli("report", *base, *args)  # later options override earlier ones
    assert code == 2 and message in " ".join(err.split()) and "Traceback" not in err  # the CLI wraps lines
