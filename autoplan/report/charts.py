"""Charts as SVG text (matplotlib, Agg backend, no network): inlined in HTML, files beside Markdown.

Every chart's key artists carry a stable SVG id (matplotlib `gid`) so tests and readers can find
them: `time-cost-frontier`, `time-cost-point-<gpu>-<n>`, `memory-<part>-stage-<r>`,
`memory-capacity`, `step-<part>`, `pipeline-rank-<r>`.
"""

from __future__ import annotations

import io
import math
import re

import matplotlib

matplotlib.use("Agg")  # no display, no network: rendering only
import matplotlib.pyplot as plt  # noqa: E402

from autoplan.report import timeline  # noqa: E402
from autoplan.report.document import MEMORY_PARTS, step_components  # noqa: E402

CHARTS = ("time-vs-cost", "memory", "step-time", "pipeline")
COLORS = {"parameters": "#4c72b0", "gradients": "#55a868", "optimizer": "#c44e52", "activations": "#8172b2",
          "buffers": "#ccb974", "temporaries": "#da8bc3", "overhead": "#64b5cd", "compute": "#4c72b0", "recompute": "#8172b2",
          "bubble": "#bbbbbb", "other": "#777777"}
COMM_COLORS = ["#dd8452", "#c44e52", "#da8bc3", "#937860", "#ccb974", "#8c8c8c"]
DAY_S = 86400.0
STABLE_ID_PREFIXES = ("time-cost-", "memory-", "step-", "pipeline-")


def _svg(fig, name: str) -> str:
    """The figure as an inline <svg> element (ids salted by chart name so charts never collide)."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": name, "svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    text = re.sub(r"\s*<metadata>.*?</metadata>", "", text, flags=re.S)  # RDF block: dates, licence URIs
    return _prefix_ids(text[text.index("<svg"):], name)


def _prefix_ids(svg: str, name: str) -> str:
    """matplotlib numbers its own ids per figure (figure_1, patch_2): prefix them with the chart name so
    several charts inline in one page never share an id; the stable gids set above are kept."""
    own = {i for i in re.findall(r'id="([^"]+)"', svg) if not i.startswith(STABLE_ID_PREFIXES)}

    def rename(match: re.Match) -> str:
        ident = match.group(2)
        return match.group(1) + (f"{name}-{ident}" if ident in own else ident)

    return re.sub(r'(id="|url\(#|href="#)([^")]+)', rename, svg)


def time_vs_cost_svg(sweep) -> str:
    """Time to train vs cost of every fitting cluster, error bars, frontier as a line."""
    fig, ax = plt.subplots(figsize=(8, 5))
    rows = [r for r in sweep.rows if r.fits and math.isfinite(r.run.time_s)]
    markers = "osD^vP*X"
    for k, gpu in enumerate(dict.fromkeys(r.gpu for r in rows)):
        mine = [r for r in rows if r.gpu == gpu]
        for r in mine:
            x, y = r.run.time_s / DAY_S, r.run.cost_usd
            (tlo, thi), (clo, chi) = r.run.time_range_s, r.run.cost_range_usd
            bars = ax.errorbar([x], [y], xerr=[[x - tlo / DAY_S], [thi / DAY_S - x]], yerr=[[y - clo], [chi - y]],
                               fmt=markers[k % len(markers)], color=f"C{k}", alpha=0.9, capsize=2,
                               label=gpu if r is mine[0] else None)
            bars.lines[0].set_gid(f"time-cost-point-{r.gpu}-{r.num_gpus}")
            ax.annotate(str(r.num_gpus), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    front = sorted((r for r in rows if r.frontier), key=lambda r: r.run.time_s)
    if front:
        (line,) = ax.plot([r.run.time_s / DAY_S for r in front], [r.run.cost_usd for r in front], "--",
                          color="black", linewidth=1, label="Pareto frontier", drawstyle="steps-post")
        line.set_gid("time-cost-frontier")
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_ticks(ax.xaxis, "{:g}")
    _plain_log_ticks(ax.yaxis, "${:,.0f}")
    ax.set_xlabel("time to train (days, with checkpoints and interruptions)")
    ax.set_ylabel("cost (USD)")
    ax.set_title(f"{sweep.model}: time vs cost" + (" (bars: measured cost-model error)" if sweep.error else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _svg(fig, "time-vs-cost")


def _plain_log_ticks(axis, fmt: str) -> None:
    """Label a log axis at 1, 2 and 5 times powers of ten as plain numbers; matplotlib's default
    mantissa x 10^k labels on minor ticks overlap when the range spans less than a decade."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: fmt.format(v)))
    axis.set_minor_formatter(NullFormatter())


def memory_svg(estimate: dict, capacity_gib: float, title: str) -> str:
    """Per pipeline stage (rank) stacked memory parts against the GPU's capacity."""
    stages = estimate["per_stage"]
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(stages) + 3), 4.5))
    xs = list(range(len(stages)))
    bottom = [0.0] * len(stages)
    for part in MEMORY_PARTS:
        values = [s["memory_breakdown_gib"].get(part, 0.0) for s in stages]
        bars = ax.bar(xs, values, bottom=bottom, color=COLORS[part], label=part, width=0.6)
        for r, patch in enumerate(bars.patches):
            patch.set_gid(f"memory-{part}-stage-{r}")
        bottom = [b + v for b, v in zip(bottom, values)]
    cap = ax.axhline(capacity_gib, color="red", linestyle="--", linewidth=1.2, label=f"capacity {capacity_gib:.0f} GiB")
    cap.set_gid("memory-capacity")
    ax.set_xticks(xs, [f"stage {s['stage']}" for s in stages])
    ax.set_ylabel("GiB per GPU")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _svg(fig, "memory")


def step_time_svg(labelled: list[tuple[str, dict]], title: str) -> str:
    """Horizontal stacked bars of the step-time parts, one bar per plan."""
    fig, ax = plt.subplots(figsize=(8, max(2.2, 0.45 * len(labelled) + 1.5)))
    kinds = list(dict.fromkeys(p for _, e in labelled for p, _ in step_components(e)))
    comm = [k for k in kinds if k.startswith("comm ")]
    left = [0.0] * len(labelled)
    for kind in kinds:
        values = [dict(step_components(e)).get(kind, 0.0) for _, e in labelled]
        color = COMM_COLORS[comm.index(kind) % len(COMM_COLORS)] if kind in comm else COLORS[kind]
        bars = ax.barh(range(len(labelled)), values, left=left, color=color, label=kind, height=0.6)
        for i, patch in enumerate(bars.patches):
            patch.set_gid(f"step-{kind.replace(' ', '-')}-{i}")
        left = [a + b for a, b in zip(left, values)]
    ax.set_yticks(range(len(labelled)), [label for label, _ in labelled])
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _svg(fig, "step-time")


def pipeline_svg(plan, estimate: dict) -> str:
    """Forward/backward of each micro-batch on each pipeline rank over one step."""
    pp, m, vpp, schedule = plan.pp, plan.num_microbatches, plan.vpp, plan.schedule
    shown = timeline.shown_microbatches(schedule, pp, m)
    times = [s["time_per_microbatch_s"] for s in estimate["per_stage"]]
    ops = timeline.simulate(schedule, pp, shown, times, vpp)
    fig, ax = plt.subplots(figsize=(10, max(2.0, 0.5 * pp + 1.5)))
    for r in range(pp):
        mine = [op for op in ops if op.rank == r]
        for kind, color in (("F", "#4c72b0"), ("B", "#dd8452")):
            for chunk in range(max(vpp, 1)):  # later model chunks lighter (interleaved schedules)
                spans = [(op.start_s, op.end_s - op.start_s) for op in mine if op.kind == kind and op.chunk == chunk]
                if not spans:
                    continue
                coll = ax.broken_barh(spans, (r - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.3,
                                      alpha=1.0 - 0.45 * chunk / max(vpp - 1, 1),
                                      label={"F": "forward", "B": "backward"}[kind] if r == 0 and chunk == 0 else None)
                coll.set_gid(f"pipeline-rank-{r}-{kind}" + (f"-chunk-{chunk}" if chunk else ""))
        if len(mine) <= 64:  # label micro-batches while they are readable
            for op in mine:
                ax.text((op.start_s + op.end_s) / 2, r, str(op.microbatch), ha="center", va="center",
                        fontsize=6, color="white")
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds into the step")
    note = f", first {shown} of {m} micro-batches" if shown < m else f", {m} micro-batches"
    ax.set_title(f"pipeline schedule: {schedule}" + (f" (vpp={vpp})" if vpp > 1 else "") + f", pp={pp}{note}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _svg(fig, "pipeline")
