"""Expert parallelism for an MoE layer whose experts are an nn.ModuleList that the layer's
own Python loop calls (Mixtral's original code, hand-written MoEs).

Supported loops: the layer's forward reaches its experts only through `self.experts`
(iterating it, or indexing it with an int) and only calls them, each call with one tensor of
tokens (any leading shape, hidden size last) returning a tensor of that same shape, any
number of calls per expert; each expert is token-wise (a row's output depends on that row
only, as every FFN expert). Which tokens go where, their weights and the combination are the
layer's own code, run unchanged; so is anything else in its forward (a shared expert).

How: each ep rank keeps the modules of its own experts under their own names (the state dict
and checkpoints keep `experts.3.w1.weight`); the others become `RemoteExpert` stand-ins
without parameters. The layer's forward is replaced on the instance by one that runs the
user's forward twice, from the same RNG state:
  1. record: every expert call hands its tokens to the runtime and gets zeros back;
  2. the recorded tokens of all experts go to the ranks owning them in one all-to-all
     (models.moe.dispatch_to_owners), through those ranks' expert modules, and back;
  3. replay: every expert call returns its result from step 2, in call order.
Step 3's output is the layer's output: the routing weights reach the loss through it, the
expert inputs through step 1's token selection. The layer's code outside the experts (router,
shared expert) runs twice; a routing that differs between the two runs is an error.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from autoplan.errors import UserError
from autoplan.models.moe import dispatch_to_owners


def module_list_problem(experts: nn.ModuleList) -> str | None:
    """None when the experts are a list this module can shard, else why not."""
    if len(experts) == 0:
        return "its experts list is empty"
    shapes = [sorted((n, tuple(p.shape)) for n, p in e.named_parameters()) for e in experts]
    if not shapes[0] or any(s != shapes[0] for s in shapes):
        return "its experts (an nn.ModuleList) do not all hold parameters of the same names and shapes"
    ids = [id(p) for e in experts for _, p in e.named_parameters(remove_duplicate=False)]
    if len(ids) != len(set(ids)):
        return "its experts (an nn.ModuleList) share parameters with each other"
    return None


class RemoteExpert(nn.Module):
    """Where an expert held by another ep rank was: no parameters, never called directly."""

    def __init__(self, index: int, owner: int) -> None:
        super().__init__()
        self.index, self.owner = index, owner

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"expert {self.index} is held by ep rank {self.owner}; only the "
                           "expert-parallel forward of its MoE layer calls it")


class _Slot:
    """What the user's loop sees as expert `index` during the runtime's two runs."""

    def __init__(self, index: int, call, layer: str) -> None:
        self.index, self._call, self._layer = index, call, layer

    def __call__(self, *args, **kwargs):
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            raise UserError(f"{self._layer} calls expert {self.index} with {len(args)} positional "
                            f"and {len(kwargs)} keyword arguments; expert parallelism of an "
                            "nn.ModuleList MoE supports experts called with one tensor of tokens. "
                            "Use ep=1 for this model.")
        return self._call(self.index, args[0])

    def __getattr__(self, name: str):
        raise UserError(f"{self._layer}'s forward reads `{name}` of expert {self.index}; expert "
                        "parallelism of an nn.ModuleList MoE supports loops that only call their "
                        "experts (each rank holds only its own). Use ep=1 for this model.")


@contextmanager
def _experts_as(experts: nn.ModuleList, call, layer: str):
    """The list yields slots instead of modules while the user's forward runs."""
    held = experts._modules
    experts._modules = {key: _Slot(i, call, layer) for i, key in enumerate(held)}
    try:
        yield
    finally:
        experts._modules = held


class _Record:
    """Step 1: each expert's calls, flattened to (rows, hidden)."""

    def __init__(self, num_experts: int) -> None:
        self.calls: list[list[torch.Tensor]] = [[] for _ in range(num_experts)]
        self.shapes: list[list[torch.Size]] = [[] for _ in range(num_experts)]

    def __call__(self, index: int, tokens: torch.Tensor) -> torch.Tensor:
        self.calls[index].append(tokens.reshape(-1, tokens.shape[-1]))
        self.shapes[index].append(tokens.shape)
        return torch.zeros_like(tokens)


class _Replay:
    """Step 3: each expert call's result, in call order."""

    def __init__(self, outputs: list[list[torch.Tensor]], layer: str) -> None:
        self.outputs, self.layer = [list(reversed(o)) for o in outputs], layer

    def __call__(self, index: int, tokens: torch.Tensor) -> torch.Tensor:
        pending = self.outputs[index]
        if not pending or pending[-1].shape != tokens.shape:
            raise RuntimeError(f"{self.layer} routed tokens differently in the two runs of its "
                               "forward (expert parallelism of an nn.ModuleList MoE needs the "
                               "routing to depend only on its inputs and the RNG state)")
        return pending.pop()

    def check_done(self) -> None:
        if any(self.outputs):
            raise RuntimeError(f"{self.layer} called its experts fewer times in the second run "
                               "of its forward than in the first")


def _hidden_states(args, kwargs) -> torch.Tensor:
    """The layer's first float tensor input: the tokens' width, dtype and device when this
    rank routed none (it still takes part in the all-to-all)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    raise UserError("an nn.ModuleList MoE layer under expert parallelism got no float tensor "
                    "input. Use ep=1 for this model.")


def _run_experts(local: list[nn.Module], first: int, layer: str):
    """run_local of dispatch_to_owners: this rank's experts over their received tokens. Every
    expert runs, even on no tokens, so its replicas' FSDP collectives stay in step."""

    def run(tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outputs = []
        for offset, (expert, chunk) in enumerate(zip(local, torch.split(tokens, counts))):
            out = expert(chunk)
            if not isinstance(out, torch.Tensor) or out.shape != chunk.shape:
                raise UserError(f"expert {first + offset} of {layer} maps tokens {tuple(chunk.shape)} "
                                f"to {getattr(out, 'shape', type(out).__name__)}; expert parallelism "
                                "of an nn.ModuleList MoE needs experts that return one tensor of "
                                "their input's shape. Use ep=1 for this model.")
            outputs.append(out)
        return torch.cat(outputs)

    return run


def _exchange(record: _Record, hidden: torch.Tensor, group, run_local):
    """Step 2: every expert's recorded tokens through its owner; results split per call."""
    flat = [t for calls in record.calls for t in calls]
    tokens = torch.cat(flat) if flat else hidden.new_zeros(0, hidden.shape[-1])
    counts = torch.tensor([sum(t.shape[0] for t in calls) for calls in record.calls],
                          dtype=torch.long, device=tokens.device)
    out = dispatch_to_owners(tokens, counts, group, run_local)
    pieces = iter(out.split([t.shape[0] for t in flat]))
    return [[next(pieces).reshape(shape) for shape in shapes] for shapes in record.shapes]


def _rng_states(device: torch.device):
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _set_rng_states(states, device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


def _parallel_forward(moe: nn.Module, local: list[nn.Module], first: int,
                      group: dist.ProcessGroup, layer: str):
    user_forward = moe.forward  # the bound method of the user's class
    experts = moe.experts
    run_local = _run_experts(local, first, layer)

    def forward(*args, **kwargs):
        hidden = _hidden_states(args, kwargs)
        rng = _rng_states(hidden.device)
        record = _Record(len(experts))
        with _experts_as(experts, record, layer):
            user_forward(*args, **kwargs)
        outputs = _exchange(record, hidden, group, run_local)
        _set_rng_states(rng, hidden.device)
        replay = _Replay(outputs, layer)
        with _experts_as(experts, replay, layer):
            result = user_forward(*args, **kwargs)
        replay.check_done()
        return result

    return forward


def apply_list_expert_parallel(moe: nn.Module, axis, layer: str) -> list[nn.Module]:
    """Keep this ep rank's experts of `moe`, stand-ins for the rest, and route through them;
    returns this rank's expert modules."""
    rank, size = axis.get_local_rank(), axis.size()
    experts: nn.ModuleList = moe.experts
    per_rank = len(experts) // size
    first = rank * per_rank
    for index in range(len(experts)):
        if not first <= index < first + per_rank:
            experts[index] = RemoteExpert(index, index // per_rank)
    local = [experts[i] for i in range(first, first + per_rank)]
    # an instance attribute: the class (and every other model) keeps its own forward
    moe.forward = _parallel_forward(moe, local, first, axis.get_group(), layer)
    return local
