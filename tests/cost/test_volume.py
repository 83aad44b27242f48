"""The cost model's collective volume (cost/volume.py): which window a collective falls in."""

from __future__ import annotations

from autoplan.cost.volume import END, FIRST, MICROBATCH, Traffic, by_kind


def test_a_once_a_step_gather_is_in_the_last_micro_batch_only_when_it_is_the_first():
    # ZeRO-2 gathers its weights with the first micro-batch and keeps them to the last
    # backward; the dry run measures the last micro-batch and the step's end
    traffic = [Traffic("reduce_scatter", "float32", 400, MICROBATCH),
               Traffic("all_gather", "bfloat16", 200, FIRST),
               Traffic("all_reduce", "float32", 10, END)]
    assert by_kind(traffic, 1, "last micro-batch") == {("reduce_scatter", "float32"): 400,
                                                       ("all_gather", "bfloat16"): 200,
                                                       ("all_reduce", "float32"): 10}
    assert by_kind(traffic, 4, "last micro-batch") == {("reduce_scatter", "float32"): 400,
                                                       ("all_reduce", "float32"): 10}
    assert by_kind(traffic, 4) == {("reduce_scatter", "float32"): 1600,
                                   ("all_gather", "bfloat16"): 200, ("all_reduce", "float32"): 10}
