"""Expert parallelism: each ep rank keeps num_experts/ep experts of every MoE layer.

Four expert layouts are sharded, the first two and the last stacked (E, ...) so that EP slices dim 0:
  autoplan.models.moe.MoE      GroupedExperts w_gate/w_up/w_down; the layer dispatches itself
                               once `ep_group` is set.
  Hugging Face fused experts   an `experts` module holding `gate_up_proj` (E, 2I, H) and
                               `down_proj` (E, H, I), called as experts(hidden_states,
                               top_k_index, top_k_weights) (Mixtral, Qwen2-MoE, ... in
                               transformers 5). The model's own router still routes; the
                               experts' forward is replaced on the instance by the same
                               dispatch (all-to-all to the owning rank and back), computing
                               each expert as transformers does: act(gate) * up, down, times
                               the routing weight, summed per token.
  per-expert nn.ModuleList     called by the layer's own Python loop: each ep rank keeps its
                               experts' modules (same names) and the layer's forward runs the
                               user's loop around one all-to-all (expert_list.py).
  other stacked experts  an `experts` module of parameters stacked by expert (E, ...) only,
                         E its `num_experts`, called as experts(hidden_states, indices,
                         weights) (GPT-OSS: biases, [gate, up] interleaved, a clamped SwiGLU):
                         the same dispatch, each rank running the module's own forward on the
                         tokens it received, with its local experts and their count in place
                         of the whole stack's (expert_stack.py).
Other layouts (a ModuleDict, experts holding submodules) are refused with a reason
(`expert_parallel_supported`), so the planner can leave ep at 1.

The stacked expert weights become DTensors sharded on dim 0 over the ep axis, so DCP saves
them by expert index (reshardable to another EP degree) and grad-norm clipping counts each
expert once; a list's experts stay plain tensors, each on its own rank, so the gradient
norm sums their squares over the ep axis (precision.grad_norm). Either way an expert's
gradient already sums the contributions of the whole ep group (the all-to-all backward
brings them home), so it needs summing only over the ranks that hold the same experts
(dp_replicate x ep_rest), divided by dp*cp: the same average the DP wrappers give every
other parameter.
  ZeRO-2/3: each layer's `experts` module (each local expert of a list) is an FSDP unit of
            its own on that expert-replica mesh (ParallelMesh.expert_dp_mesh, as torchtitan's
            fully_shard on its dp-mod-ep mesh; data_parallel.apply_fsdp): FSDP casts the
            weights once per gather, reduce-scatters the gradients with divide factor dp*cp,
            and the optimizer steps the fp32 shards.
  ZeRO-0/1: kept out of DDP (whose C++ reducer cannot hold DTensors, nor parameters that
            differ across its ranks); `sync_expert_grads`
            all-reduces their gradients after backward.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autoplan.errors import UserError
from autoplan.models.moe import MoE, compute_weight, dispatch_to_owners
from autoplan.runtime.expert_list import apply_list_expert_parallel, module_list_problem
from autoplan.runtime.expert_stack import own_forward_on, stacked_layout_problem
from autoplan.runtime.mesh import local_part
from autoplan.runtime.tying import shares_outside, tied_groups

_FUSED_PARAMS = ("gate_up_proj", "down_proj")
_FUSED_INPUTS = ["hidden_states", "top_k_index", "top_k_weights"]
# transformers' use_experts_implementation flags; anything but these defaults changes the math.
_FUSED_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False,
                "is_concatenated": True, "has_post_expert_norm": False}


def _fused_layout_problem(experts: nn.Module) -> str | None:
    """None when `experts` is the Hugging Face fused layout this module shards, else why not."""
    names = sorted(name for name, _ in experts.named_parameters(recurse=False))
    if names != sorted(_FUSED_PARAMS):
        return f"its experts hold parameters {names}, not exactly {list(_FUSED_PARAMS)}"
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if gate_up.ndim != 3 or down.ndim != 3 or gate_up.shape[0] != down.shape[0] \
            or gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
        return (f"its experts' weights {tuple(gate_up.shape)} / {tuple(down.shape)} are not "
                "(E, 2I, H) / (E, H, I)")
    flags = {k: getattr(experts, k) for k, v in _FUSED_FLAGS.items() if getattr(experts, k, v) != v}
    if flags:
        return f"its experts use a layout variant ({flags}) the runtime does not shard"
    if not callable(getattr(experts, "act_fn", None)):
        return "its experts have no act_fn"
    try:
        inputs = list(inspect.signature(experts.forward).parameters)
    except (TypeError, ValueError):
        inputs = []
    if inputs != _FUSED_INPUTS:
        return f"its experts' forward takes {inputs}, not {_FUSED_INPUTS}"
    return None


def num_experts_of(module: nn.Module) -> int:
    if isinstance(module, MoE):
        return module.num_experts
    if isinstance(module.experts, nn.ModuleList):
        return len(module.experts)
    return _stack_size(module.experts)


def _stack_size(experts: nn.Module) -> int:
    """How many experts a stacked `experts` module holds (the global count once sharded)."""
    return experts.num_experts if hasattr(experts, "num_experts") else experts.gate_up_proj.shape[0]


def expert_parallel_supported(module: nn.Module) -> str | None:
    """None when expert parallelism can shard this MoE layer, else the reason it cannot."""
    if isinstance(module, MoE):
        return None
    experts = getattr(module, "experts", None)
    if isinstance(experts, nn.ModuleList):
        return module_list_problem(experts)
    if isinstance(experts, nn.ModuleDict):
        return ("its experts are an nn.ModuleDict; expert parallelism shards an nn.ModuleList "
                "of experts or stacked (E, ...) expert weights")
    if not isinstance(experts, nn.Module):
        return "it has no `experts` submodule (not an MoE layer the runtime knows)"
    fused = _fused_layout_problem(experts)
    return fused and stacked_layout_problem(experts)


# the TP style of an MoE layer: token-wise, it runs on the rank's tokens with its weights whole
# (a router and experts of any layout; expert parallelism is another question, is_moe_layer)
TOKEN_WISE_MOE = "moe"


def is_moe_layer(module: nn.Module) -> bool:
    """An MoE layer whose experts the runtime can shard (token-wise as a whole)."""
    return expert_parallel_supported(module) is None


def check_ep_modules(model: nn.Module, ep_modules: list[str], ep: int) -> None:
    modules = dict(model.named_modules())
    if not ep_modules:
        raise UserError(f"the plan asks for ep={ep} but lists no MoE modules (plan.ep_modules); "
                        "expert parallelism needs a model with MoE layers. Use ep=1.")
    for path in ep_modules:
        module = modules.get(path)
        if module is None:
            raise UserError(f"plan.ep_modules names {path!r}, which is not in the model. "
                            "Use ep=1 for this model or re-run `autoplan plan`.")
        reason = expert_parallel_supported(module)
        if reason is not None:
            raise UserError(f"plan.ep_modules names {path!r} ({type(module).__name__}), which "
                            f"expert parallelism cannot shard: {reason}. Use ep=1 for this model.")
        shared = shares_outside(tied_groups(model), f"{path}.experts")
        if shared is not None:
            raise UserError(f"expert parallelism would untie the parameter shared as "
                            f"{' = '.join(shared)}: each ep rank keeps its own experts of "
                            f"{path}, and the other users would keep the whole tensor. Use ep=1 "
                            "for this model or untie it.")
        if num_experts_of(module) % ep:
            raise UserError(f"{path} has {num_experts_of(module)} experts, not divisible by "
                            f"ep={ep}; choose an ep that divides the expert count.")


def _shard(owner: nn.Module, names: tuple[str, ...], axis: DeviceMesh) -> list[nn.Parameter]:
    """Replace owner.<name> by its dim-0 shard of this ep rank, as a DTensor parameter."""
    rank, size = axis.get_local_rank(), axis.size()
    params = []
    for name in names:
        full = getattr(owner, name).detach()
        local = full.chunk(size, dim=0)[rank].clone()
        param = nn.Parameter(DTensor.from_local(local, axis, [Shard(0)], run_check=False))
        setattr(owner, name, param)
        params.append(param)
    return params


def _fused_experts_on(experts: nn.Module):
    """run_local(tokens, counts) of transformers' fused layout: act(gate) * up, then down, per
    local expert, as transformers computes them."""

    def run_local(tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        gate_up, down = (compute_weight(w, tokens) for w in (experts.gate_up_proj, experts.down_proj))
        outputs = []
        for index, chunk in enumerate(torch.split(tokens, counts)):
            gate, up = F.linear(chunk, gate_up[index]).chunk(2, dim=-1)
            outputs.append(F.linear(experts.act_fn(gate) * up, down[index]))
        return torch.cat(outputs)

    return run_local


def _expert_parallel_forward(experts: nn.Module, group: dist.ProcessGroup, run_local):
    """experts(hidden_states, top_k_index, top_k_weights) with this rank's experts only: the
    tokens dispatched to the experts' ranks, `run_local` there, the outputs weighed and summed
    per token."""
    num_experts = _stack_size(experts)

    def forward(hidden_states, top_k_index, top_k_weights):
        top_k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of_slot = order // top_k
        counts = torch.bincount(flat, minlength=num_experts)
        out = dispatch_to_owners(hidden_states[token_of_slot], counts, group, run_local)
        out = out * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, token_of_slot,
                                                          out.to(hidden_states.dtype))

    return forward


def apply_expert_parallel(model: nn.Module, ep_modules: list[str], ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Shard the experts of this (stage) module; returns the modules holding this rank's
    experts (each layer's `experts`, or each local expert of a list)."""
    axis = ep_mesh["ep"]
    modules = dict(model.named_modules())
    sharded = []
    for path in ep_modules:
        moe = modules.get(path)
        if moe is None:
            continue  # on another pipeline stage
        if isinstance(moe, MoE):
            moe.ep_group = axis.get_group()
            _shard(moe.experts, ("w_gate", "w_up", "w_down"), axis)
        elif isinstance(moe.experts, nn.ModuleList):  # each local expert is a unit of its own
            sharded += apply_list_expert_parallel(moe, axis, path)
            continue
        else:
            fused = _fused_layout_problem(moe.experts) is None
            run_local = _fused_experts_on(moe.experts) if fused else own_forward_on(moe.experts)
            _shard(moe.experts, _FUSED_PARAMS if fused else
                   tuple(n for n, _ in moe.experts.named_parameters(recurse=False)), axis)
            # an instance attribute: the class (and every other model) keeps its own forward
            moe.experts.forward = _expert_parallel_forward(moe.experts, axis.get_group(), run_local)
        sharded.append(moe.experts)
    return sharded


def expert_fsdp_placement(experts: nn.Module, shard_ranks: int):
    """FSDP's shard placement for one layer's experts: dim 0 (the local experts) unless there
    are fewer local experts than ranks to shard over, where dim-0 shards would be empty or
    padded; then dim 1, as torchtitan does, when it divides evenly (FSDP2 shards dims > 0
    only evenly). None keeps FSDP's default, dim 0."""
    params = list(experts.parameters())
    if not params or not isinstance(params[0], DTensor):  # one expert of a list: FSDP's dim 0
        return None
    local_experts = params[0].to_local().shape[0]
    if shard_ranks <= 1 or local_experts % shard_ranks == 0:
        return None
    if all(p.ndim > 1 and p.shape[1] % shard_ranks == 0 for p in params):
        return lambda _param: Shard(1)
    return None


def sync_expert_grads(params: list[nn.Parameter], ep_mesh: DeviceMesh, dp_cp: int) -> None:
    """Sum expert grads over the ranks holding the same experts; divide by dp*cp."""
    for param in params:
        if param.grad is None:
            continue
        grad = local_part(param.grad)
        for axis in ("dp_replicate", "ep_rest"):
            if ep_mesh[axis].size() > 1:
                dist.all_reduce(grad, group=ep_mesh[axis].get_group())
        grad.div_(dp_cp)
