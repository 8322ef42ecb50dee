"""On an exact tie (predicted step time, GPUs and peak memory), the plan with fewer parallel
dimensions ranks first: a planner should not recommend context or pipeline parallelism that buys
nothing (the BLOOM-176B plan under the Megatron-DeepSpeed profile tied tp4/pp12/dp8 with a cp=2
twin and picked the twin by its plan string)."""
from __future__ import annotations

import json

import pytest
from clirun import run


def _axes(p: dict) -> int:
    return sum(int(p[k] > 1) for k in ("tp", "pp", "cp", "ep", "virtual_stages"))


@pytest.mark.parametrize("argv", [
    ["--model", "bloom-176b", "--cluster", "jean-zay-a100", "--global-batch", "2048", "--seq-len", "2048",
     "--profile", "megatron-deepspeed"],
    ["--model", "llama3-8b", "--cluster", "h100-sxm-80gb:16", "--global-batch", "64", "--seq-len", "8192"],
])
def test_exact_ties_rank_the_simpler_plan_first(capsys, argv):
    rc, out, err = run(capsys, "plan", *argv, "--top", "10", "--json")
    assert rc == 0, err
    plans = json.loads(out)["plans"]
    for a, b in zip(plans, plans[1:]):
        ca, cb = a["cost"], b["cost"]
        if (ca["step_time_s"], a["num_gpus"], ca["peak_memory_gib"]) == (cb["step_time_s"], b["num_gpus"],
                                                                          cb["peak_memory_gib"]):
            assert _axes(a["plan"]) <= _axes(b["plan"]), (a["short"], b["short"])


def test_bloom_under_its_own_profile_does_not_pick_a_tied_context_parallel_twin(capsys):
    rc, out, err = run(capsys, "plan", "--model", "bloom-176b", "--cluster", "jean-zay-a100", "--global-batch",
                       "2048", "--seq-len", "2048", "--profile", "megatron-deepspeed", "--json")
    assert rc == 0, err
    best = json.loads(out)["plans"][0]["plan"]
    assert best["cp"] == 1, best
