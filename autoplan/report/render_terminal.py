"""Terminal report: rich tables of the same numbers as the Markdown and HTML reports."""

from __future__ import annotations

from typing import Any

from autoplan.report.formatting import count, degrees, duration, pct, setup, time_range, usd, usd_range


def print_report(doc: dict[str, Any], console) -> None:
    """Print a sweep or plan document (see document.py) with rich."""
    from rich.table import Table

    console.print(f"[bold]autoplan report: {doc['model']}[/]  {count(doc['tokens'])} tokens, seq {doc['seq_len']}, "
                  f"global batch {doc['global_batch']}, {doc['precision']}, prices {doc['price_list']}")
    err = doc["error"]
    console.print(f"How sure: {err['source']}; ranges are ±{pct(err['relative'])}"
                  + (" [red](stale: cost model changed since)[/]" if err["stale"] else "")
                  if err else "How sure: no measured error available; point estimates only")
    if doc["kind"] == "sweep":
        rec = Table(title="Recommendations")
        for col in ("objective", "cluster", "why"):
            rec.add_column(col, no_wrap=col != "why")
        for name, r in doc["recommendations"].items():
            rec.add_row(name, r["label"] or "none", r["why"])
        console.print(rec)
        for name, r in doc["recommendations"].items():
            if r.get("generate"):
                console.print(f"{name}: the job, with sky.yaml and pytorchjob.yaml:", markup=False)
                console.print(f"  {r['generate']}", markup=False, soft_wrap=True)
        for table in _clusters_tables(doc, console.width):
            console.print(table)
        runners_up = _runners_up_table(doc)
        if runners_up is not None:
            console.print(runners_up)
        for r in doc["rows"]:
            if not r["fits"]:
                console.print(f"  {r['label']} does not fit: {r['reason']}")
            elif r.get("search", {}).get("time_limited"):
                s = r["search"]
                console.print(f"  {r['label']}: the {s['time_limit_s']:g} s time limit stopped the search: "
                              f"searched {s['searched']} of {s['total']} configurations; the best found is "
                              f"shown (--time-limit SECONDS searches longer)")
    if doc.get("detail"):
        _print_detail(doc["detail"], console)
    a = doc["assumptions"]
    console.print(f"Assumptions: {a['failures_per_gpu_hour']:.3g} failures per GPU-hour "
                  f"({a['sources']['failures_per_gpu_hour']}); checkpoint write "
                  f"{a['checkpoint_write_bytes_per_s_per_gpu'] / 1e6:.0f} MB/s per GPU; "
                  f"restart {duration(a['restart_s'])}.")


# (header, wraps between words); columns that do not wrap keep each line of a cell whole (a
# range such as "95 min – 2.4 h" is read as one)
CLUSTER_COLUMNS = (("cluster", False), ("plan", True), ("step", False), ("MFU", False), ("GiB used / free", False),
                   ("time to train", False), ("GPU-hours", False), ("cost", False), ("goodput", False),
                   ("checkpoint every", False))


def _cluster_cells(r: dict[str, Any]) -> list[str]:
    if not r["fits"]:
        return [r["label"], "[dim]does not fit (below)[/]", *[""] * 8]
    return [("* " if r["frontier"] else "") + r["label"], f"{degrees(r['config'])}\n{setup(r['config'])}",
            duration(r["step_time_s"]), pct(r["mfu"]), f"{r['memory_gib_per_gpu']:.1f} / {r['headroom_gib']:.1f}",
            f"{duration(r['time_to_train_s'])}\n[dim]{time_range(r['time_range_s'])}[/]",
            count(r["gpu_hours"]), f"{usd(r['cost_usd'])}\n[dim]{usd_range(r['cost_range_usd'])}[/]",
            pct(r["goodput"]["fraction"]), duration(r["goodput"]["checkpoint_interval_s"])]


def _lines(cells: list[str], wraps: bool) -> list[str]:
    """What must stay on one line: each word of a wrapping column, else each line of a cell."""
    from rich.text import Text

    return [piece for cell in cells for line in Text.from_markup(cell).plain.split("\n")
            for piece in (line.split() if wraps else [line])]


# when one table does not fit: the plan's columns, then the run's (each split further if needed)
SPLIT = (("plan", "step", "MFU", "GiB used / free"),
         ("time to train", "GPU-hours", "cost", "goodput", "checkpoint every"))


def _table_width(widths: dict[str, int], headers: list[str]) -> int:
    """Each column takes its width, a space either side and one rule; one more rule closes the table."""
    return sum(widths[h] + 3 for h in headers) + 1


def _column_groups(widths: dict[str, int], width: int) -> list[list[str]]:
    """The columns as few tables as fit `width`, every table starting with the cluster."""
    everything = list(widths)
    if _table_width(widths, everything) <= width:
        return [everything]
    groups = []
    for part in SPLIT:
        groups.append(["cluster"])
        for header in part:
            if _table_width(widths, groups[-1] + [header]) > width and len(groups[-1]) > 1:
                groups.append(["cluster"])
            groups[-1].append(header)
    return groups


def _clusters_tables(doc: dict[str, Any], width: int) -> list:
    """The clusters table, or narrower ones (the cluster in each) when one does not fit.

    Column widths are set here, not left to rich, so that a value is never cut or broken:
    every column is as wide as its longest unbreakable piece (headers break between words),
    and the plan column, which wraps between words, takes the room left up to its longest line.
    """
    from rich.table import Table

    rows = [_cluster_cells(r) for r in doc["rows"]]
    index = [h for h, _ in CLUSTER_COLUMNS]
    widths = {h: max([len(w) for w in h.split()] + [len(p) for p in _lines([row[i] for row in rows], wraps)])
              for i, (h, wraps) in enumerate(CLUSTER_COLUMNS)}
    plan_longest = max([len(p) for p in _lines([row[index.index("plan")] for row in rows], False)] + [4])
    groups = _column_groups(widths, width)
    tables = []
    for k, group in enumerate(groups):
        title = "Clusters (* = on the Pareto frontier of time vs cost)" + (
            f", {k + 1} of {len(groups)}" if len(groups) > 1 else "")
        table = Table(title=title)
        room = width - sum(widths[h] + 3 for h in group if h != "plan") - 4
        for header in group:
            column_width = max(widths[header], min(plan_longest, room)) if header == "plan" else widths[header]
            table.add_column(header, justify="left" if header in ("cluster", "plan") else "right",
                             width=column_width)
        for row in rows:
            table.add_row(*(row[index.index(h)] for h in group))
        tables.append(table)
    return tables


def _runners_up_table(doc: dict[str, Any]):
    """Each cluster's runners-up (`report --top K`), or None when none were asked for."""
    from rich.table import Table

    rows = [(r, a) for r in doc["rows"] if r["fits"] for a in r.get("runners_up", [])]
    if not rows:
        return None
    table = Table(title="Runners-up per cluster")
    for col in ("cluster", "plan", "step", "vs best", "GiB"):
        table.add_column(col, justify="left" if col in ("cluster", "plan") else "right", no_wrap=col != "plan")
    for r, a in rows:
        table.add_row(r["label"], f"{degrees(a['config'])}, {setup(a['config'])}", duration(a["step_time_s"]),
                      f"{a['step_time_s'] / r['step_time_s'] - 1:+.1%}", f"{a['memory_gib_per_gpu']:.1f}")
    return table


def _print_detail(d: dict[str, Any], console) -> None:
    from rich.table import Table

    from autoplan.report.document import MEMORY_PARTS

    g = d["goodput"]
    head = Table(title=d["title"], show_header=False)
    head.add_row("plan", f"{degrees(d['config'])}, {setup(d['config'])}, {d['num_microbatches']} micro-batch"
                     + ("es" if d["num_microbatches"] != 1 else ""))
    head.add_row("step time", f"{duration(d['step_time_s'])} ({count(d['tokens_per_s_per_gpu'])} tokens/s per GPU, "
                              f"MFU {pct(d['mfu'])})")
    head.add_row("memory per GPU", f"{d['memory_gib_per_gpu']:.1f} of {d['capacity_gib']:.1f} GiB "
                                   f"({d['headroom_gib']:.1f} GiB headroom)")
    head.add_row("time to train", f"{duration(d['time_to_train_s'])} ({time_range(d['time_range_s'])}), "
                                  f"{d['steps']:,} steps")
    unpriced = " (the price list gives this device 0 USD per hour; --price GPU=USD sets one)" \
        if not d["usd_per_gpu_hour"] else ""
    head.add_row("cost", f"{usd(d['cost_usd'])} ({usd_range(d['cost_range_usd'])}), {count(d['gpu_hours'])} "
                         f"GPU-hours{unpriced}")
    head.add_row("checkpoints", f"{g['checkpoint_bytes'] / 1e9:.0f} GB, {duration(g['checkpoint_write_s'])} to write; "
                                f"Young/Daly interval {duration(g['checkpoint_interval_s'])} "
                                f"(every {g['checkpoint_interval_steps']} steps)")
    head.add_row("interruptions", f"job MTBF {duration(g['job_mtbf_s'])}, "
                                  f"{g['expected_interruptions'] or 0:.1f} expected, "
                                  f"{duration(g['lost_s_per_interruption'])} of work lost each; "
                                  f"goodput {pct(g['fraction'])}")
    console.print(head)
    mem = Table(title="Memory per pipeline stage (GiB per GPU)")
    for col in ("stage", "blocks", *MEMORY_PARTS, "total"):
        mem.add_column(col, justify="right", overflow="fold")  # a narrow terminal folds a header, never cuts it
    for s in d["per_stage"]:
        mem.add_row(str(s["stage"]), str(s["blocks"]),
                    *[f"{s['memory_breakdown_gib'].get(p, 0):.2f}" for p in MEMORY_PARTS], f"{s['memory_gib']:.2f}")
    console.print(mem)
    step = Table(title="Step time")
    for part in [*d["step_parts_s"], "step"]:
        step.add_column(part, justify="right")
    step.add_row(*[duration(s) for s in d["step_parts_s"].values()], duration(d["step_time_s"]))
    console.print(step)
