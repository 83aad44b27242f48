"""Plan -> a runnable job directory: train.py, launch.sh, slurm.sbatch, plan.json, README.md, the
plan for other stacks (ds_config.json, torchtitan.toml, megatron.args) and, on request, the cloud
launch files (sky.yaml, pytorchjob.yaml).

Every decision (launch shape, environment settings, how train.py builds the model, what the
README says) is made here in Python; the jinja2 templates in templates/ only lay the values
out (StrictUndefined: a missing value fails the render). User-supplied strings never reach a
template raw: Python code gets them through the `py` filter (repr), shell code through `sh`
(shlex.quote), Markdown through `md`, YAML through `yaml` (a JSON string). Anything else a template prints must be a number or a
string of "safe" characters (`_checked`), so an unquoted model name or path fails the render
instead of producing broken or injectable code.

`python -m autoplan.commands.examples --regenerate-examples` rewrites the committed examples in generated/.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jinja2

from autoplan.codegen.exports import EXPORTS, export_files, export_notes
from autoplan.codegen.launchers import LAUNCH_FILES, launcher_context
from autoplan.codegen.runtime_wheel import runtime_wheel, wheel_name
from autoplan.errors import UserError
from autoplan.files import refuse_link, write_file
from autoplan.plan import Plan
from autoplan.paths import templates_dir

# What a template may print unquoted: no whitespace, quotes, backslashes, $, `, ;, braces, #.
_SAFE_TEXT = re.compile(r"[A-Za-z0-9_.,:/=+@%-]*")
_EXECUTABLE = ("launch.sh", "slurm.sbatch", "train.py")


class Quoted(str):
    """Text already escaped for the place it is printed (output of the py/sh/md filters)."""


def py_quote(value: Any) -> Quoted:
    """A Python literal for a str/number/bool/None/list/dict value (repr: always valid, never raw)."""
    return Quoted(py_literal(value))


def sh_quote(value: Any) -> Quoted:
    """One shell word (POSIX single quotes where needed)."""
    return Quoted(shlex.quote(str(value)))


def yaml_quote(value: Any) -> Quoted:
    """One YAML flow scalar: the JSON string of the value's text (always valid, never raw)."""
    return Quoted(json.dumps(str(value)))


def md_escape(value: Any) -> Quoted:
    """Text safe inside a Markdown paragraph or table cell (one line, no markup, no HTML)."""
    text = " ".join(str(value).split())
    return Quoted(re.sub(r"([\\`*_{}\[\]<>#!|~])", r"\\\1", text))


def _checked(value: Any) -> Any:
    """jinja2 `finalize`: refuse a raw string that is not safe to print anywhere."""
    if isinstance(value, (Quoted, int, float, jinja2.Undefined)) or value is None:
        return value  # an Undefined raises when printed (StrictUndefined)
    if isinstance(value, str) and _SAFE_TEXT.fullmatch(value):
        return value
    raise ValueError(f"template printed an unescaped string {value!r}; pass it through py, sh or md")


def py_literal(value: Any, indent: int = 0, width: int = 100) -> str:
    """A Python literal of JSON-like data: inline when it fits `width`, else broken over lines.

    Strings and numbers go through repr (exact floats, escaped strings). Lists, and dicts of
    plain values, pack several entries to a line so long lists of module paths stay short; a
    dict holding containers gets one entry per line.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if not isinstance(value, (dict, list, tuple)):
        return repr(value)
    if isinstance(value, dict):
        items = [f"{py_literal(k)}: {py_literal(v, indent + 4, width)}" for k, v in value.items()]
        opening, closing = "{", "}"
        pack = not any(isinstance(v, (dict, list, tuple)) for v in value.values())
    else:
        items = [py_literal(v, indent + 4, width) for v in value]
        opening, closing, pack = "[", "]", True
    inline = opening + ", ".join(items) + closing
    if "\n" not in inline and indent + len(inline) <= width:
        return inline
    pad = " " * (indent + 4)
    lines: list[str] = []
    for item in items:
        fits = lines and len(pad) + len(lines[-1]) + len(item) + 2 <= width
        if pack and fits and "\n" not in item and "\n" not in lines[-1]:
            lines[-1] += f" {item},"
        else:
            lines.append(f"{item},")
    return opening + "\n" + "".join(f"{pad}{line}\n" for line in lines) + " " * indent + closing


def safe_name(text: str) -> str:
    """A directory/job name from user text: runs of other characters become one '-'."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", str(text)).strip("-.")
    return name or "job"


def default_output_dir(plan: Plan) -> Path:
    """generated/<model>-<gpus>x<gpu> (relative to the current directory)."""
    return Path("generated") / job_name(plan)


def job_name(plan: Plan) -> str:
    return f"{safe_name(plan.model.name)}-{plan.world_size}x{safe_name(plan.gpu)}"


# ---------------------------------------------------------------- how train.py builds the model


@dataclass(frozen=True)
class ModelSource:
    """How the generated train.py builds the model, decided when the job is generated."""

    kind: str  # "catalog" | "config" | "transformers" | "file"
    catalog_name: str = ""
    copy_name: str = ""  # file copied into the job dir: "config.json" or "model.py"
    copy_bytes: bytes = b""
    builder_name: str = ""  # file models: "build_model", "model" or the model class name
    builder_call: str = ""  # what follows namespace[builder_name]: "(seq_len=...)", "()" or ""


# train.py's imports beyond the common ones, per ModelSource.kind: (standard library, autoplan)
_MODEL_IMPORTS = {
    "catalog": ([], ["from autoplan.models.catalog import load_catalog_config",
                     "from autoplan.models import build_model as build_reference_model"]),
    "config": (["import json"], ["from autoplan.models import build_model as build_reference_model"]),
    "transformers": (["import json"], ["from autoplan.models.hf import build_transformers_model"]),
    "file": (["import runpy"], []),
}


def train_imports(kind: str) -> str:
    """The import block of train.py, sorted as isort would."""
    stdlib, ours = _MODEL_IMPORTS[kind]
    stdlib = sorted(["import os", *stdlib]) + ["from pathlib import Path"]
    ours = sorted(["from autoplan import runtime", "from autoplan.errors import UserError",
                   "from autoplan.models.sources import fingerprint", *ours])
    return "\n".join(["from __future__ import annotations", "", *stdlib, "", "import torch.nn as nn",
                      "", *ours])


def model_source(spec: str, source: str, name: str, model_class: str) -> ModelSource:
    """The ModelSource of MODEL `spec` (what load_model read: source catalog|config|file)."""
    if source == "catalog":
        return ModelSource("catalog", catalog_name=name)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if spec.startswith("hf:"):
        path = Path(spec[3:])
        path = path / "config.json" if path.is_dir() else path
    if source in ("config", "transformers"):
        return ModelSource(source, copy_name="config.json", copy_bytes=path.read_bytes())
    text = path.read_bytes()
    builder, call = _file_builder(text, model_class)
    return ModelSource("file", copy_name="model.py", copy_bytes=text, builder_name=builder,
                       builder_call=call)


def _file_builder(source: bytes, model_class: str) -> tuple[str, str]:
    """The rule of autoplan.models.sources: build_model(), else a module-level `model`, else the class."""
    tree = ast.parse(source)
    bound: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound.update({t.id: node for t in targets if isinstance(t, ast.Name)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    if "build_model" in bound:
        node = bound["build_model"]
        takes_seq = isinstance(node, ast.FunctionDef) and any(
            a.arg == "seq_len" for a in node.args.args + node.args.kwonlyargs)
        return "build_model", '(seq_len=PLAN["seq_len"])' if takes_seq else "()"
    if "model" in bound:
        return "model", ""
    return model_class, "()"


# ---------------------------------------------------------------- rendering


def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, autoescape=False,
                             finalize=_checked)
    env.filters.update(py=py_quote, sh=sh_quote, md=md_escape, yaml=yaml_quote)
    return env


def launch_shape(plan: Plan) -> tuple[int, int]:
    """(nodes, processes per node) for torchrun; every node runs the same number of processes."""
    per_node = min(plan.gpus_per_node, plan.world_size)
    if plan.world_size % per_node:
        raise UserError(
            f"the plan uses {plan.world_size} GPUs with {plan.gpus_per_node} per node, so its last "
            "node would be partial; torchrun starts the same number of processes on every node. "
            "Plan for a multiple of the GPUs per node, or give --gpus-per-node that divides --gpus.")
    return plan.world_size // per_node, per_node


def env_settings(plan: Plan, nnodes: int) -> list[dict[str, str]]:
    """Environment variables the launch scripts export (each overridable by the caller)."""
    if plan.gpu == "cpu":
        settings = [("OMP_NUM_THREADS", "1", "gloo ranks share this machine's cores: one thread each")]
    else:
        settings = [
            ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True",
             "fewer fragmentation OOMs near the memory limit (as torchtitan's run_train.sh)"),
            ("NCCL_DEBUG", "WARN", "NCCL says why a collective failed"),
        ]
        if nnodes > 1:
            settings.append(("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1",
                             "a rank that dies aborts the job instead of hanging the others"))
    return [{"name": name, "value": value, "reason": Quoted(reason)} for name, value, reason in settings]


def render_job(plan: Plan, source: ModelSource, *, command_line: str,
               price: tuple[float, str] | None = None, gpu_memory_gib: float | None = None,
               launchers: tuple[str, ...] = (), versions: dict[str, str] | None = None) -> dict[str, bytes]:
    """All files of the job directory, name -> content. Pure: reads only the templates (and,
    with launchers, autoplan's own runtime sources for the wheel the nodes install).

    `launchers` adds the cloud launch files (skypilot: sky.yaml, k8s: pytorchjob.yaml) to the
    torchrun and SLURM scripts every job has."""
    env = environment()
    nnodes, nproc = launch_shape(plan)
    job_plan = plan_of_job(plan, source)
    common = {"job_name": job_name(plan), "world_size": plan.world_size, "nnodes": nnodes,
              "nodes": Quoted(f"{nnodes} node" + ("s" if nnodes > 1 else "")),
              "nproc_per_node": nproc, "gpu": safe_name(plan.gpu),
              "env_settings": env_settings(plan, nnodes), "launches": launch_examples(nnodes),
              "images": plan.inputs.get("kind") == "images"}
    train = env.get_template("train.py.j2").render(
        **common, plan_literal=Quoted(py_literal(job_plan.to_dict())), source=source,
        import_block=Quoted(train_imports(source.kind)),
        model_template=f"model_{source.kind}.py.j2", builder_call=Quoted(source.builder_call))
    sbatch_extra = [] if plan.gpu == "cpu" else [f"--gpus-per-node={nproc}"]
    files = {
        "train.py": train,
        "launch.sh": env.get_template("launch.sh.j2").render(**common),
        "slurm.sbatch": env.get_template("slurm.sbatch.j2").render(**common, sbatch_extra=sbatch_extra),
        "plan.json": job_plan.to_json(),
        **export_files(plan, versions),
        "README.md": env.get_template("job_README.md.j2").render(
            **common, **readme_context(plan, source, command_line, price, gpu_memory_gib, launchers),
            stacks=stack_rows(launchers), stack_notes=[
                (name, [md_escape(n) for n in notes]) for name, notes in export_notes(plan, versions)]),
    }
    context = launcher_context(plan, job_name(plan), nnodes, nproc)
    for launcher in launchers:
        name = LAUNCH_FILES[launcher]
        files[name] = env.get_template(f"{name}.j2").render(**common, **context)
    out = {name: text.encode() for name, text in files.items()}
    if launchers:  # the cloud nodes install autoplan's runtime from this file, by path
        out[wheel_name()] = runtime_wheel()
    if source.copy_name:
        out[source.copy_name] = source.copy_bytes
    return out


def plan_of_job(plan: Plan, source: ModelSource) -> Plan:
    """The plan as the job holds it: its model is the copy in the job directory (a path
    relative to plan.json, with the copy's sha256), so `autoplan check JOB` loads that copy."""
    if not source.copy_name:
        return plan
    sha = hashlib.sha256(source.copy_bytes).hexdigest()
    return replace(plan, model=replace(plan.model, path=source.copy_name, file_sha256=sha))


def write_job(files: dict[str, bytes], out_dir: Path, force: bool) -> list[Path]:
    """Write the files into out_dir; refuses an output path that is a file, or a non-empty dir without force."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output path {out_dir} is a file, not a directory; give -o a directory "
                        "(new or empty) for the job")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        present = sorted(p.name for p in out_dir.iterdir())
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise UserError(f"{out_dir} already holds files ({shown}); pass --force to overwrite the job's "
                        "files there (others are kept), or choose another directory with -o")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise UserError(f"cannot create {out_dir}: a part of the path is a file ({exc.filename}); "
                        "choose another -o directory") from None
    for name in files:  # before writing any: a refused job leaves the folder as it was
        refuse_link(out_dir / name)
    written = []
    for name, content in files.items():
        write_file(out_dir / name, content, executable=name in _EXECUTABLE)
        written.append(out_dir / name)
    return written


def stack_rows(launchers: tuple[str, ...]) -> list[tuple[Quoted, Quoted, Quoted]]:
    """The README's table: (stack, file, how to start it) for every stack the job serves."""
    def cloud(launcher: str, command: str) -> tuple[str, str]:
        name = LAUNCH_FILES[launcher]
        return (name, command) if launcher in launchers else (
            f"{name} (not written)", f"generate again with --launcher {launcher}")

    rows = [("autoplan.runtime, torchrun", "launch.sh", "./launch.sh --steps 100"),
            ("autoplan.runtime, SLURM", "slurm.sbatch", "sbatch slurm.sbatch --steps 100"),
            ("autoplan.runtime, SkyPilot (managed spot job)",
             *cloud("skypilot", "sky jobs launch -n JOB sky.yaml --env CHECKPOINT_BUCKET=BUCKET")),
            ("autoplan.runtime, Kubernetes (Kubeflow PyTorchJob, training-operator v1)",
             *cloud("k8s", "kubectl apply -f pytorchjob.yaml (set the volume claim first)")),
            ("autoplan.runtime, Kubernetes (Kubeflow Trainer v2 TrainJob)",
             *cloud("trainjob", "kubectl apply -f trainjob.yaml (set the volume claim first)")),
            ("torchtitan", EXPORTS["torchtitan"].file_name,
             "torchrun ... -m torchtitan.train (the header gives the release it is written for and its command)"),
            ("Megatron-LM", EXPORTS["megatron"].file_name,
             "set -f; torchrun ... pretrain_gpt.py $(grep -v '^#' megatron.args) plus your model and data arguments"),
            ("DeepSpeed", EXPORTS["deepspeed"].file_name,
             "deepspeed your_train.py --deepspeed_config ds_config.json")]
    return [(md_escape(stack), md_escape(name), md_escape(command)) for stack, name, command in rows]


def launch_examples(nnodes: int) -> list[tuple[Quoted, Quoted]]:
    """The commands a README and train.py's docstring show, for this many nodes."""
    if nnodes == 1:
        first = ("On this node", "./launch.sh --steps 100 --checkpoint-every 50")
    else:
        first = (f"On each of the {nnodes} nodes, with the host:port of the first node",
                 "RDZV_ENDPOINT=node0:29500 RDZV_ID=run1 ./launch.sh --steps 100 --checkpoint-every 50")
    examples = [first,
                ("On SLURM, submitted from this directory",
                 "sbatch slurm.sbatch --steps 100 --checkpoint-every 50"),
                ("Continue from the last checkpoint",
                 first[1].replace("--steps 100", "--steps 200") + " --resume")]
    return [(Quoted(what), Quoted(command)) for what, command in examples]


def readme_context(plan: Plan, source: ModelSource, command_line: str,
                   price: tuple[float, str] | None, gpu_memory_gib: float | None,
                   launchers: tuple[str, ...] = ()) -> dict[str, Any]:
    """The README's tables as rows of escaped (label, value) text."""
    what = {"catalog": "the autoplan catalog model", "config": "the HF-style config",
            "transformers": "the Hugging Face transformers class of the config",
            "file": "the model file"}[source.kind]
    model = f"{what} {plan.model.name}" + (f" ({plan.model.path})" if plan.model.path else "")
    return {"model_md": md_escape(model), "command_line": Quoted(command_line),
            "plan_rows": _rows(_plan_rows(plan)),
            "estimate_rows": _rows(_estimate_rows(plan, price, gpu_memory_gib)),
            "files": [(name, md_escape(what)) for name, what in _file_rows(source, launchers)]}


def _rows(rows: list[tuple[str, str]]) -> list[tuple[Quoted, Quoted]]:
    return [(md_escape(label), md_escape(value)) for label, value in rows]


def _plan_rows(plan: Plan) -> list[tuple[str, str]]:
    modes = list(plan.recompute.values())
    opt = plan.optimizer
    hsdp = f" ({plan.dp_replicate} replicas x {plan.dp_shard} shards)" if plan.dp_replicate > 1 else ""
    rows = [
        ("parallelism", f"dp={plan.dp}{hsdp} tp={plan.tp} pp={plan.pp} cp={plan.cp} ep={plan.ep}"),
        ("ZeRO / offload", f"stage {plan.zero_stage} / {plan.offload}"),
        ("batch", f"{plan.global_batch} sequences x {plan.seq_len} tokens = "
                  f"{plan.global_batch * plan.seq_len:,} tokens per step; micro-batch {plan.micro_batch}, "
                  f"{plan.num_microbatches} micro-batches per step"),
        ("precision", plan.precision),
        ("recomputation", f"{modes.count('full')} blocks full, {modes.count('selective')} selective, "
                          f"{modes.count('none')} none"),
    ]
    if plan.pp > 1:
        rows.append(("pipeline", f"{plan.schedule}, {plan.vpp} virtual stages per rank, blocks per "
                                 f"stage {[len(s) for s in plan.stages]}"))
    if plan.tp > 1:
        classes = sum(1 for scope in plan.tp_styles if scope)
        rows.append(("tensor parallel", f"styles for {classes} block class(es) and "
                                        f"{len(plan.tp_styles.get('', {}))} other modules, sequence parallel "
                                        f"{'on' if plan.sequence_parallel else 'off'}"))
    rows.append(("optimizer", f"{opt.get('name', 'adamw')} lr {opt.get('lr')} betas {opt.get('betas')} "
                              f"weight decay {opt.get('weight_decay')}, warmup {opt.get('warmup_steps')} "
                              f"of {opt.get('max_steps')} steps, clip {opt.get('grad_clip')}"))
    return rows


def _estimate_rows(plan: Plan, price: tuple[float, str] | None,
                   gpu_memory_gib: float | None) -> list[tuple[str, str]]:
    est = plan.estimate or {}
    if not est.get("step_time_s"):
        return [("estimate", "none in plan.json (run `autoplan estimate --plan plan.json`)")]
    step_s = float(est["step_time_s"])
    tokens = plan.global_batch * plan.seq_len
    memory = f"{est.get('memory_gib_per_gpu', float('nan')):.1f} GiB"
    if gpu_memory_gib:
        memory += f" of {gpu_memory_gib:.0f} GiB"
    if plan.memory_headroom_gib:
        memory += f", planned to leave at least {plan.memory_headroom_gib:g} GiB free"
    parts = est.get("memory_breakdown_gib") or {}
    rows = [
        ("step time", f"{step_s:.3f} s"),
        ("throughput", f"{tokens / step_s:,.0f} tokens/s ({tokens / step_s / plan.world_size:,.0f} per GPU)"),
        ("MFU", f"{float(est.get('mfu', 0.0)):.1%}"),
        ("memory per GPU", memory + (" (GiB: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
                                     + ")" if parts else "")),
    ]
    times = est.get("time_breakdown_s") or {}
    if times:
        rows.append(("time per step", ", ".join(f"{k} {v:.3f} s" for k, v in times.items())))
    if price is None:
        rows.append(("cost", f"no price known for {plan.gpu} (cost_models/prices)"))
    else:
        usd_per_gpu_hour, where = price
        cluster_per_hour = usd_per_gpu_hour * plan.world_size
        rows += [("price", f"{usd_per_gpu_hour:.2f} USD per GPU-hour ({where})"),
                 ("cost", f"{cluster_per_hour:,.2f} USD per hour, {cluster_per_hour * step_s / 3600:.4f} "
                          f"USD per step, {cluster_per_hour * step_s / 3600 / tokens * 1e9:,.2f} USD per "
                          "billion tokens")]
    return rows


def _file_rows(source: ModelSource, launchers: tuple[str, ...]) -> list[tuple[str, str]]:
    rows = [("train.py", "the plan as data, the model, then autoplan.runtime (run it with torchrun)"),
            ("plan.json", "the exact plan (autoplan estimate/report --plan plan.json)")]
    if source.copy_name:
        rows.append((source.copy_name, "a copy of the model the plan was made for; train.py builds it"))
    if launchers:
        rows.append((wheel_name(), "autoplan's runtime (torch and the standard library only), which the "
                     "cloud nodes install by path: `pip install --no-deps ./" + wheel_name() + "`"))
    return rows

