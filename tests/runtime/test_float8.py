"""The runtime's fp8 conversion is torchao's own: the same linears swapped, the same numbers."""

from __future__ import annotations

import copy

import pytest
import torch

import torch.distributed as dist

from autoplan.config import FLOAT8_RECIPES
from autoplan.errors import UserError
from autoplan.runtime.float8 import ByteAllGather, apply_float8, require_torchao
from runtime_models import builder, float8_reference

pytest.importorskip("torchao.float8", reason="torchao is not installed (the test extra installs it)")


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = builder("llama")()
    model.to_empty(device="cpu")
    model.init_weights()
    return model


@pytest.mark.parametrize("recipe", FLOAT8_RECIPES)
def test_the_runtime_converts_the_blocks_linears_as_torchao_does(recipe):
    ours, theirs = _llama(), None
    theirs = copy.deepcopy(ours)
    apply_float8(ours, [f"layers.{i}" for i in range(4)], recipe)
    float8_reference(theirs, recipe)
    granularity = {m.config.cast_config_input.scaling_granularity.value for m in ours.modules()
                   if type(m).__name__ == "Float8Linear"}
    assert granularity == {"tensorwise" if recipe == "tensorwise" else "axiswise"}
    kinds = lambda m: [(name, type(mod).__name__) for name, mod in m.named_modules()]  # noqa: E731
    assert kinds(ours) == kinds(theirs)
    assert sum(kind == "Float8Linear" for _, kind in kinds(ours)) == 28  # 7 per block
    assert type(ours.lm_head).__name__ == "Linear"  # the head stays in 16 bits
    ids = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = ours(ids), theirs(ids)
    assert torch.equal(a, b)
    a.float().square().mean().backward()
    b.float().square().mean().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters()))


def test_only_the_listed_blocks_are_converted():
    model = _llama()
    apply_float8(model, ["layers.1"])
    converted = {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert converted and all(name.startswith("layers.1.") for name in converted)


def test_linears_a_tp_style_computes_itself_stay_in_16_bits():
    """MLA's up-projections under TP run their own F.linear on the local weight
    (latent_attention.py): a Float8Linear there would silently not cast."""
    from autoplan.plan import Plan
    from autoplan.runtime.tensor_parallel import local_input_linears
    from runtime_models import plan_dict

    model = _llama()
    styles = {"layers.*": {"self_attn.q_proj": "colwise_local", "self_attn.o_proj": "rowwise"}}
    plan = Plan.from_dict(plan_dict(tp=2, tp_styles=styles, format_version=2))
    keep = local_input_linears(model, plan)
    assert keep == {f"layers.{i}.self_attn.q_proj" for i in range(4)}
    apply_float8(model, [f"layers.{i}" for i in range(4)], keep=keep)
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    assert kinds["layers.0.self_attn.q_proj"] == "Linear" and kinds["layers.0.self_attn.o_proj"] == "Float8Linear"


def test_the_float8_all_gather_makes_the_weights_torchaos_fsdp_cast_tensors():
    model = _llama()
    apply_float8(model, ["layers.0"], "tensorwise", all_gather=True)
    weights = {type(m.weight).__name__ for m in model.modules() if type(m).__name__ == "Float8Linear"}
    assert weights == {"WeightWithDynamicFloat8CastTensor"}  # what FSDP gathers in float8


@pytest.fixture
def one_rank_gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_float8_shards_go_through_gloo_as_their_bytes(one_rank_gloo):
    shard = torch.tensor([1.5, -2.0, 448.0]).to(torch.float8_e4m3fn)
    gathered = torch.empty(3, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="Invalid scalar type"):  # gloo has no float8 types
        dist.all_gather_single(gathered, shard, group=one_rank_gloo)
    ByteAllGather()(gathered, shard, one_rank_gloo)
    assert gathered.view(torch.uint8).equal(shard.view(torch.uint8))


def test_a_node_without_torchao_is_told_how_to_get_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(UserError, match="pip install torchao"):
        require_torchao()
