"""Shared (tied) parameters stay shared under every parallel axis.

Models (tied_models.py): autoplan's Llama and a transformers LlamaForCausalLM with
tie_word_embeddings, and a hand-written GPT whose head shares the embedding's weight but has
its own bias and whose two blocks share one LayerNorm. Each trains 8 steps at a constant LR
of 1e-2 (warmup 0) on 2 ranks (one torchrun launch) and is compared with an independent
single-process loop: the losses, every parameter by name after the last step (tied names
included) and how many distinct parameters the runtime holds.

Tolerances: losses 1e-5 relative (fp32 summation order only; measured <= 2.1e-6); each
parameter's difference 1e-2 of its norm (measured <= 3.4e-3, on a bias that starts at zero:
AdamW at lr 1e-2 turns summation-order noise in near-zero gradients into lr-sized steps).
An untied copy drifts by 1e-2 in the losses and by ~1 of the embedding's norm.
"""

from __future__ import annotations

import json

import pytest
import torch

from runtime_models import llama_tp_styles
from tied_models import build, plan_dict as P, reference_run

LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-2

# autoplan's Llama at tp2 and pp2 trains tied in test_parity.py (tied_tp2, tied_pp2_1f1b)
TRAINED = {
    "hf_llama_tp2": ("hf_llama", P("hf_llama", tp=2)),
    "gpt_tp2": ("gpt", P("gpt", tp=2)),
    "llama_dp2_zero3": ("llama", P("llama", dp=2, zero_stage=3)),
    "gpt_dp2_zero3": ("gpt", P("gpt", dp=2, zero_stage=3)),
    # a copy per pipeline stage, gradients summed over the stages (pipeline.StageTie): the
    # embedding and the head, and in the GPT also a LayerNorm its two blocks share
    "hf_llama_pp2": ("hf_llama", P("hf_llama", pp=2)),
    "gpt_pp2": ("gpt", P("gpt", pp=2)),
    # the V placement puts the first and the last stage on pipeline rank 0: a copy each there
    "llama_pp2_v": ("llama", P("llama", pp=2, vpp=2, schedule="zero-bubble",
                               stages=[["layers.0"], ["layers.1"], ["layers.2"], ["layers.3"]])),
}

# copies that cannot be summed into one parameter, refused on every rank before training:
# sharded differently by the stages' TP styles (a vocabulary-parallel embedding, a whole
# head), or different from the start (a model initialised from the rank)
REFUSED = {
    "llama_pp2_tp2_head_whole": ("llama", P("llama", pp=2, tp=2, tp_styles={
        k: v for k, v in llama_tp_styles().items() if k != "lm_head"}),
        "embed_tokens.weight is sharded differently"),
    "gpt_initialised_by_rank_pp2_dp2": ("gpt_by_rank", P("gpt_by_rank", pp=2, dp=2),
                                        "tok.weight on the pipeline stages using it start with "
                                        "different values"),
}


@pytest.fixture(scope="module")
def results(torchrun, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tied")
    cases = {n: c[:2] for n, c in TRAINED.items()}
    configs = [{"name": name, "kind": kind, "plan": plan} for name, (kind, plan) in cases.items()]
    (tmp / "configs.json").write_text(json.dumps(configs))
    (tmp / "out").mkdir()
    proc = torchrun("tied_worker.py", 2, tmp / "configs.json", tmp / "out", tmp / "run", timeout=600)  # ~60 s on idle cores
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {name: torch.load(tmp / "out" / f"{name}.pt") for name in cases}


@pytest.fixture(scope="module")
def references():
    return {kind: reference_run(kind) for kind in ("llama", "hf_llama", "gpt")}


@pytest.mark.parametrize("name", TRAINED)
def test_tied_parameters_train_as_one_parameter(results, references, name):
    kind = TRAINED[name][0]
    got = results[name]
    assert "error" not in got, got.get("error")
    ref_losses, ref_params = references[kind]
    worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref_losses))
    assert len(got["losses"]) == len(ref_losses) and worst <= LOSS_RTOL, (got["losses"], ref_losses)
    assert set(got["params"]) == set(ref_params)
    for param_name, ref in ref_params.items():
        drift = float((got["params"][param_name] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert drift <= PARAM_RTOL, f"{name}: {param_name} is off by {drift:.2e} of its norm"
    with torch.device("meta"):  # a pipeline rank holds its own stage's copy of a shared one
        assert got["distinct"] == len(list(build(kind).parameters())) or TRAINED[name][1].get("pp", 1) > 1


@pytest.fixture(scope="module")
def refusals(torchrun, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tied_refused")
    configs = [{"name": name, "kind": kind, "plan": plan} for name, (kind, plan, _) in REFUSED.items()]
    (tmp / "configs.json").write_text(json.dumps(configs))
    (tmp / "out").mkdir()
    proc = torchrun("tied_worker.py", 4, tmp / "configs.json", tmp / "out", tmp / "run", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {name: torch.load(tmp / "out" / f"{name}.pt") for name in REFUSED}


@pytest.mark.parametrize("name", REFUSED)
def test_copies_that_cannot_be_one_parameter_are_refused_naming_it(refusals, name):
    error = refusals[name].get("error", "")
    assert REFUSED[name][2] in error, error
