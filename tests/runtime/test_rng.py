"""Dropout streams under tensor parallelism (runtime/rng.py ShardDropouts, and the regions
tensor_parallel.py opens them in).

A TP rank's heads or columns must get a mask of their own, not the same pattern as the other
ranks' shards; an activation every rank holds whole must get the same mask on every rank,
or the replicas of one weight compute different gradients; and recomputation must draw the
masks of the forward again."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from autoplan.runtime.rng import ShardDropouts
import hf_models
from runtime_models import traced_plan_dict


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device"))]


def _draws(tp_rank: int, device: str, seed: int = 7) -> dict[str, torch.Tensor]:
    """What one rank draws inside and after ShardDropouts, from the shared seed."""
    torch.manual_seed(seed)
    x = torch.ones(4, 64, device=device)
    q = torch.randn(1, 2, 8, 4, device=device)
    with ShardDropouts(tp_rank):
        dropped = F.dropout(x, 0.5)
        attention = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
        no_dropout = F.scaled_dot_product_attention(q, q, q)
        other = torch.rand(4, device=device)  # not a mask over the shard: the shared stream
    return {"dropout": dropped, "attention": attention, "no_dropout": no_dropout, "other": other,
            "after": torch.rand(16, device=device), "dropout_after": F.dropout(x, 0.5)}


@pytest.mark.parametrize("device", DEVICES)  # CUDA moves its Philox offset instead of drawing
def test_each_tp_rank_draws_its_own_mask_and_the_shared_stream_moves_on_alike(device):
    rank0, rank1, again = _draws(0, device), _draws(1, device), _draws(0, device)
    assert not torch.equal(rank0["dropout"], rank1["dropout"])
    assert not torch.equal(rank0["attention"], rank1["attention"])
    for name in ("no_dropout", "other", "after", "dropout_after"):
        assert torch.equal(rank0[name], rank1[name]), name
    # the same shared state draws the same masks again (what recomputation relies on)
    assert all(torch.equal(rank0[name], again[name]) for name in rank0)
    # a mask is 0 or 1/(1-p) everywhere: the rank's stream is an ordinary dropout
    assert set(rank0["dropout"].unique().tolist()) == {0.0, 2.0}


DIFFER, MATCH = 2, 1  # distinct masks over the two ranks of a 2-rank case
GPT2_SP_MASKS = ["transformer.drop", "transformer.h.0.attn.resid_dropout", "transformer.h.1.mlp.dropout"]
BERT_MASKS = ["bert.embeddings.dropout", "bert.encoder.layer.0.attention.output.dropout",
              "bert.encoder.layer.1.output.dropout"]
CASES = {  # world: {name: (kind, plan overrides, distinct masks over the ranks, per nn.Dropout)}
    2: {"gpt2_sp": ("hf_gpt2_dropout", {"tp": 2, "sequence_parallel": True},
                    dict.fromkeys(GPT2_SP_MASKS, DIFFER)),
        "gpt2_no_sp": ("hf_gpt2_dropout", {"tp": 2, "sequence_parallel": False},
                       dict.fromkeys(GPT2_SP_MASKS, MATCH)),
        "t5": ("hf_t5_dropout", {"tp": 2},
               {"encoder.block.0.layer.1.DenseReluDense.dropout": DIFFER,
                "decoder.block.1.layer.2.DenseReluDense.dropout": DIFFER,
                "encoder.dropout": MATCH, "encoder.block.0.layer.1.dropout": MATCH,
                "decoder.block.1.layer.0.dropout": MATCH}),
        # each rank its part of the sequence: no mask is over a whole activation
        "gpt2_cp": ("hf_gpt2_dropout_cp", {"cp": 2}, dict.fromkeys(GPT2_SP_MASKS, DIFFER))},
    # cp2 x tp2: under SP all four ranks hold different tokens; without SP the tp pairs
    # hold the same tokens outside the column/row pairs, which the two cp ranks do not
    4: {"bert_cp_tp_sp": ("hf_bert_dropout", {"cp": 2, "tp": 2, "sequence_parallel": True},
                          dict.fromkeys(BERT_MASKS, 4)),
        "bert_cp_tp_no_sp": ("hf_bert_dropout", {"cp": 2, "tp": 2, "sequence_parallel": False},
                             dict.fromkeys(BERT_MASKS, 2)),
        # a stream per pipeline stage, shared by the stage's data parallel replicas (no module
        # is on every rank here, so the masks are the streams')
        "gpt2_pp_dp": ("hf_gpt2_dropout", {"pp": 2, "dp": 2}, {})},
}
# the pipeline ranks of the processes sharing each random stream once the model is made: one
# stream on every rank, except that each pipeline rank draws from its own
STREAMS = {"gpt2_pp_dp": [[0, 0], [1, 1]]}
RECOMPUTED = {"gpt2_sp", "t5", "bert_cp_tp_sp"}


@pytest.mark.parametrize("world", sorted(CASES))
def test_ranks_draw_their_own_masks_on_their_shards_and_replicas_stay_identical(torchrun, tmp_path, world):
    """Real transformers GPT-2, T5 and BERT with their stock 0.1 dropouts, 2 steps per plan: the
    masks over a rank's own columns (T5's MLP at tp=2), tokens (GPT-2 under SP, or any
    context parallelism) differ between the ranks holding other parts, those over whole
    activations are the same, every replicated weight is bitwise the same on every rank
    after training, and recomputing every block trains to the same losses (the masks are
    drawn again, not anew; checkpointing's early stop leaves a region's closing hook unrun)."""
    configs = []
    for name, (kind, over, masks) in CASES[world].items():
        plan = traced_plan_dict(kind, **over)
        plan.update(over)
        configs.append({"name": name, "kind": kind, "plan": plan, "masks": masks})
        if name in RECOMPUTED:
            blocks = _t5_blocks() if kind == "hf_t5_dropout" else hf_models.blocks(kind)
            configs.append(dict(configs[-1], name=f"{name}_recompute",
                                plan=dict(plan, recompute={b: "full" for b in blocks})))
    (tmp_path / "configs.json").write_text(json.dumps(configs))
    proc = torchrun("dropout_worker.py", world, tmp_path / "configs.json", tmp_path / "out.json", timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads((tmp_path / "out.json").read_text())
    for config in configs:
        result = got[config["name"]]
        assert result["streams"] == STREAMS.get(config["name"], [[0] * world]), config["name"]
        assert result["replica_spread"] == 0.0, (config["name"], result["replica_spread"])
        assert result["masks"] == config["masks"], config["name"]
        assert all(math.isfinite(loss) for loss in result["losses"]), config["name"]
    # same masks, same arithmetic: recomputation changes no loss beyond float reassociation
    for name in set(RECOMPUTED) & set(CASES[world]):
        plain, again = got[name]["losses"], got[f"{name}_recompute"]["losses"]
        assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in zip(plain, again)), (name, plain, again)


def _t5_blocks() -> list[str]:
    return [f"{side}.block.{i}" for side in ("encoder", "decoder") for i in range(2)]
