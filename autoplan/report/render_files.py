"""HTML (one self-contained file, charts inline as SVG) and Markdown (charts as SVG files beside it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autoplan.errors import UserError
from autoplan.files import write_output
from autoplan.paths import templates_dir
from autoplan.report import charts as ch
from autoplan.report.formatting import FILTERS


def render_charts(sweep=None, detail=None) -> dict[str, str]:
    """{chart name: SVG text} for a sweep (time vs cost) and a plan in depth (the other three)."""
    out: dict[str, str] = {}
    if sweep is not None:
        out["time-vs-cost"] = ch.time_vs_cost_svg(sweep)
    if detail is not None:
        out["memory"] = ch.memory_svg(detail.estimate, detail.capacity_gib, f"memory per GPU: {detail.title}")
        out["step-time"] = ch.step_time_svg(_step_bars(sweep, detail), "step time")
        out["pipeline"] = ch.pipeline_svg(detail.plan, detail.estimate)
    return out


def _step_bars(sweep, detail) -> list[tuple[str, dict]]:
    """One bar per fitting cluster of a sweep, else the one plan."""
    if sweep is None:
        return [(detail.title, detail.estimate)]
    return [(r.label, r.estimate) for r in sweep.rows if r.fits]


def _env(autoescape: bool):
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), autoescape=autoescape,
                             undefined=jinja2.StrictUndefined, trim_blocks=False, keep_trailing_newline=True)
    env.filters.update(FILTERS)
    return env


def render_html(doc: dict[str, Any], charts: dict[str, str]) -> str:
    """The report as one HTML page; every chart inline as <svg> inside <figure id="chart-NAME">."""
    from markupsafe import Markup

    return _env(True).get_template("report.html.j2").render(
        doc=doc, charts={k: Markup(v) for k, v in charts.items()}, memory_parts=ch.MEMORY_PARTS)


def render_markdown(doc: dict[str, Any], chart_files: dict[str, str]) -> str:
    """The report as Markdown; `chart_files` maps chart name to the image path written beside it."""
    return _env(False).get_template("report.md.j2").render(doc=doc, charts=chart_files,
                                                           memory_parts=ch.MEMORY_PARTS)


def markdown_chart_paths(path: Path, charts: dict[str, str]) -> dict[str, Path]:
    """Chart name -> <stem>-<name>.svg beside the Markdown file."""
    return {name: path.with_name(f"{path.stem}-{name}.svg") for name in charts}


def check_writable(paths: list[Path], force: bool) -> None:
    """UserError naming files that exist, unless --force."""
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise UserError(f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; pass --force "
                        "to overwrite, or choose another -o path.")


def write_markdown(path: Path, doc: dict[str, Any], charts: dict[str, str], force: bool) -> list[Path]:
    """Write the .md and its chart images; returns every path written."""
    images = markdown_chart_paths(path, charts)
    check_writable([path, *images.values()], force)
    for name, image in images.items():
        write_output(image, charts[name])
    write_output(path, render_markdown(doc, {name: image.name for name, image in images.items()}))
    return [path, *images.values()]
