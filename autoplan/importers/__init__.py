"""Import an existing DeepSpeed / Megatron-LM / torchtitan configuration as a ParallelConfig.

`load_imported(kind, value, num_gpus=...)` reads the user's file or argument string and
returns an `ImportedConfig`: the ParallelConfig autoplan estimates, the options it could not
model (`unsupported`, always listed, never dropped), what it assumed (`notes`) and where it
came from. Degrees that do not multiply to the GPU count, batches that do not split, or input
that does not parse are a UserError naming the fix.

Some settings depend on the model's block count (Megatron's layers per virtual stage,
torchtitan's every-n-th-block checkpointing); `ImportedConfig.for_graph(graph)` applies them
and sets the traced sequence length. The CLI pieces (`import_options`, `compare_with_option`,
`imported_from_options`) are attached to `estimate` and `plan` by their owners.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from autoplan.config import ParallelConfig
from autoplan.errors import UserError

KINDS = ("deepspeed", "megatron", "torchtitan")
DEFAULT_SEQ_LEN = 2048  # used only when neither the file nor the command line gives one (noted)


@dataclass
class ImportedConfig:
    config: ParallelConfig
    unsupported: list[str] = field(default_factory=list)  # options that change the cost but are not modelled
    notes: list[str] = field(default_factory=list)  # how each setting was read, what was assumed
    source: str = ""  # "megatron: <args>", "deepspeed: ds_config.json", ...
    seq_len: int | None = None  # sequence length the file (or command line) states; None: the model's
    num_layers: int | None = None  # block count the file states (Megatron --num-layers), for a cross-check
    layers_per_virtual_stage: int | None = None  # Megatron/torchtitan: vpp = layers / (pp * this)
    recompute_every: int | None = None  # torchtitan selective_ac_option = N: every N-th block full
    recompute_block_layers: int | None = None  # Megatron --recompute-method block: first N blocks of each stage

    def for_graph(self, graph) -> ParallelConfig:
        """The configuration for the traced model: its seq_len, vpp and per-stage recomputation."""
        return self.resolve(graph.num_layers, graph.seq_len)

    def resolve(self, layers: int, seq_len: int | None = None) -> ParallelConfig:
        """Apply the layer-dependent settings for a model of `layers` blocks (and its seq_len)."""
        config = self.config if seq_len is None else self.config.with_(seq_len=seq_len)
        if self.num_layers is not None and self.num_layers != layers:
            note = (f"the model has {layers} blocks, the imported configuration says {self.num_layers}; "
                    "the model's count is used")
            if note not in self.notes:
                self.notes.append(note)
        if self.layers_per_virtual_stage:
            stages = layers / self.layers_per_virtual_stage
            if stages != int(stages) or int(stages) % config.pp:
                raise UserError(
                    f"{self.source}: {layers} blocks in virtual stages of {self.layers_per_virtual_stage} do not "
                    f"make a multiple of pp = {config.pp} stages; choose layers per virtual stage dividing "
                    f"{layers // config.pp} (the blocks per pipeline rank)")
            vpp = int(stages) // config.pp
            schedule = "interleaved-1f1b" if vpp > 1 else (
                "1f1b" if config.schedule == "interleaved-1f1b" else config.schedule)
            config = config.with_(vpp=vpp, schedule=schedule)
        if self.recompute_block_layers:
            stages = config.pp * config.vpp
            config = config.with_(recompute="none", stage_recompute=((self.recompute_block_layers, 0),) * stages)
        if self.recompute_every:
            from autoplan.cost.stages import stage_layer_counts

            counts = stage_layer_counts(layers, config)
            config = config.with_(recompute="none",
                                  stage_recompute=tuple((c // self.recompute_every, 0) for c in counts))
        return config

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["config"] = dataclasses.asdict(self.config)
        return out


def load_imported(kind: str, value: str, *, num_gpus: int, global_batch: int | None = None,
                  seq_len: int | None = None, num_layers: int | None = None) -> ImportedConfig:
    """Read a `kind` configuration ('deepspeed' file, 'megatron' argument string or @file,
    'torchtitan' .toml) for `num_gpus` ranks. `global_batch` / `seq_len` from the command line
    replace the file's (noted); `num_layers` (the model's block count) resolves layer-dependent
    settings at once instead of in `for_graph`."""
    if kind not in KINDS:
        raise UserError(f"unknown configuration kind {kind!r}; use one of {', '.join(KINDS)}")
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise UserError(f"the number of GPUs must be a positive integer, got {num_gpus!r}")
    if kind == "deepspeed":
        from autoplan.importers.deepspeed import read
    elif kind == "megatron":
        from autoplan.importers.megatron import read
    else:
        from autoplan.importers.torchtitan import read
    imported = read(value, num_gpus=num_gpus, global_batch=global_batch, seq_len=seq_len)
    if num_layers is not None:
        imported.config = imported.resolve(num_layers)
        imported.layers_per_virtual_stage = imported.recompute_every = imported.recompute_block_layers = None
    return imported


# ---------------------------------------------------------------- shared by the three readers

def positive_int(value: Any, what: str, source: str) -> int:
    """An integer >= 1 from a file value (ints, integral floats, digit strings)."""
    try:
        number = int(value) if not isinstance(value, bool) else None
        if number is None or (isinstance(value, float) and value != number):
            raise ValueError
    except (TypeError, ValueError):
        raise UserError(f"{source}: {what} must be a positive integer, got {value!r}") from None
    if number < 1:
        raise UserError(f"{source}: {what} must be a positive integer, got {value!r}")
    return number


def data_parallel(num_gpus: int, tp: int, pp: int, cp: int, source: str, dp: int | None = None) -> int:
    """dp = GPUs / (tp x pp x cp); UserError when the degrees do not fit the GPU count."""
    model_parallel = tp * pp * cp
    if dp is not None:
        if dp * model_parallel != num_gpus:
            raise UserError(
                f"{source}: dp x tp x pp x cp = {dp} x {tp} x {pp} x {cp} = {dp * model_parallel} ranks, but "
                f"--gpus is {num_gpus}; give --gpus {dp * model_parallel} or change the degrees in the file")
        return dp
    if num_gpus % model_parallel:
        raise UserError(
            f"{source}: tp x pp x cp = {tp} x {pp} x {cp} = {model_parallel} does not divide --gpus {num_gpus}; "
            f"give a GPU count that is a multiple of {model_parallel} or change the degrees in the file")
    return num_gpus // model_parallel


def check_batch(global_batch: int, dp: int, micro_batch: int, source: str) -> None:
    if global_batch % (dp * micro_batch):
        raise UserError(
            f"{source}: the global batch of {global_batch} sequences does not split into dp {dp} x micro-batch "
            f"{micro_batch} = {dp * micro_batch}; use a global batch that is a multiple of {dp * micro_batch}")


def check_ep(ep: int, dp: int, cp: int, tp: int, source: str) -> None:
    if (dp * cp * tp) % ep:
        raise UserError(f"{source}: expert-parallel size {ep} does not divide dp x cp x tp = {dp * cp * tp}; "
                        "EP is carved from the data/context/tensor-parallel ranks")


def pick(file_value: int | None, cli_value: int | None, what: str, notes: list[str]) -> int | None:
    """The command line's value over the file's, saying so when they differ."""
    if cli_value is not None:
        if file_value is not None and file_value != cli_value:
            notes.append(f"{what} {cli_value} (asked for) replaces the file's {file_value}")
        return cli_value
    return file_value


def finish_seq_len(seq_len: int | None, notes: list[str]) -> int:
    if seq_len is None:
        notes.append(f"no sequence length given: the model's default is used (placeholder {DEFAULT_SEQ_LEN} "
                     "until the model is traced)")
        return DEFAULT_SEQ_LEN
    return seq_len


# ---------------------------------------------------------------- CLI pieces for estimate and plan

def import_options(func: Callable) -> Callable:
    """--from-deepspeed FILE, --from-megatron "ARGS" (or @FILE), --from-torchtitan FILE."""
    import click

    options = [
        click.option("--from-deepspeed", "from_deepspeed", type=click.Path(dir_okay=False), default=None,
                     metavar="FILE", help="Estimate the configuration of a DeepSpeed ds_config.json."),
        click.option("--from-megatron", "from_megatron", default=None, metavar='"ARGS"',
                     help="Estimate a Megatron-LM command line (quoted argument string, or @FILE holding it)."),
        click.option("--from-torchtitan", "from_torchtitan", type=click.Path(dir_okay=False), default=None,
                     metavar="FILE", help="Estimate the configuration of a torchtitan job .toml."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def chosen_import(from_deepspeed: str | None = None, from_megatron: str | None = None,
                  from_torchtitan: str | None = None) -> tuple[str, str] | None:
    """(kind, value) of the one --from-* option given, None if none; UserError for several."""
    given = [(k, v) for k, v in (("deepspeed", from_deepspeed), ("megatron", from_megatron),
                                 ("torchtitan", from_torchtitan)) if v]
    if len(given) > 1:
        raise UserError("give only one of --from-deepspeed, --from-megatron, --from-torchtitan")
    return given[0] if given else None


def compare_with_option(func: Callable) -> Callable:
    """--compare-with KIND=VALUE: deepspeed=ds_config.json, megatron="ARGS" or megatron=@FILE,
    torchtitan=job.toml."""
    import click

    return click.option(
        "--compare-with", "compare_with", default=None, metavar="KIND=VALUE",
        help='Show your configuration next to the best plan: deepspeed=ds_config.json, '
             'megatron="--tensor-model-parallel-size 8 ..." (or megatron=@args.txt), torchtitan=job.toml.')(func)


def parse_compare_with(value: str) -> tuple[str, str]:
    """'kind=value' -> (kind, value); UserError naming the accepted forms."""
    kind, sep, rest = (value or "").partition("=")
    kind = kind.strip().lower().removeprefix("--from-")
    if not sep or kind not in KINDS or not rest.strip():
        raise UserError(f"--compare-with expects KIND=VALUE with KIND one of {', '.join(KINDS)}, e.g. "
                        f"--compare-with deepspeed=ds_config.json; got {value!r}")
    return kind, rest.strip()


def render_imported(imported: ImportedConfig, console) -> None:
    """Print what was imported, what was assumed and what could not be modelled (rich console)."""
    c = imported.config
    console.print(f"[bold]imported[/bold] {imported.source}: dp {c.dp} x tp {c.tp} x pp {c.pp} x cp {c.cp}"
                  f"{f' (ep {c.ep})' if c.ep > 1 else ''}, ZeRO {c.zero_stage}, micro-batch {c.micro_batch}, "
                  f"global batch {c.global_batch}, {c.schedule}{f' vpp {c.vpp}' if c.vpp > 1 else ''}, "
                  f"recompute {c.recompute}, {c.precision}")
    for note in imported.notes:
        console.print(f"  note: {note}")
    for item in imported.unsupported:
        console.print(f"  [yellow]not modelled[/yellow]: {item}")
