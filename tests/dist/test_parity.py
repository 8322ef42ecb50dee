"""Every supported plan against the single-process run on the same global batch: per-step
losses and final weights within 1e-5 relative over 5 steps (fp32, gloo, CPU).

Three launches (2, 4 and 8 processes), several plans per launch.
"""
from __future__ import annotations

import pytest
from conftest import torchrun_worker

TOL = 1e-5
L4 = {"num_layers": 4}


def case(name: str, model: str, plan: str, overrides: dict | None = None, batch: int = 8) -> dict:
    return {"name": name, "model": model, "plan": plan + ",precision=fp32", "overrides": overrides or {},
            "global_batch": batch, "steps": 5}


CASES = {
    2: [case("ddp", "tiny-llama", "dp=2,zero=0,micro_batch=2"),
        case("zero1", "tiny-gpt2", "dp=2,zero=1,micro_batch=1"),
        case("zero2_moe", "tiny-moe", "dp=2,zero=2,micro_batch=2"),
        case("fsdp", "tiny-llama", "dp=2,zero=3,micro_batch=2"),
        case("tp", "tiny-llama", "tp=2,micro_batch=4"),
        case("tp_sp_gpt2", "tiny-gpt2", "tp=2,sequence_parallel=1,micro_batch=4"),
        case("tp_sp_moe", "tiny-moe", "tp=2,sequence_parallel=1,micro_batch=8"),
        case("pp_gpipe_uneven", "tiny-llama", "pp=2,schedule=gpipe,micro_batch=2,stage_layers=1:3", L4),
        case("pp_1f1b", "tiny-llama", "pp=2,schedule=1f1b,micro_batch=2", L4),
        case("pp_interleaved", "tiny-llama", "pp=2,virtual_stages=2,schedule=interleaved-1f1b,micro_batch=2", L4),
        case("pp_zero_bubble", "tiny-llama", "pp=2,virtual_stages=2,schedule=zero-bubble,micro_batch=2", L4),
        case("pp_zbv", "tiny-llama", "pp=2,virtual_stages=2,schedule=zbv,micro_batch=2", L4),
        case("ac_full_layers", "tiny-llama", "dp=2,zero=3,micro_batch=2,recompute=full,recompute_layers=1"),
        case("ac_selective_tp", "tiny-llama", "tp=2,micro_batch=2,recompute=selective"),
        case("ac_op_ddp", "tiny-llama", "dp=2,micro_batch=2,recompute=op"),
        case("cp", "tiny-llama", "cp=2,micro_batch=4"),
        case("cp_fsdp_gpt2", "tiny-gpt2", "cp=2,zero=3,micro_batch=2"),
        case("ep", "tiny-moe", "dp=2,ep=2,micro_batch=2"),
        case("ep_cp_fsdp", "tiny-moe", "cp=2,ep=2,zero=3,micro_batch=4,recompute=full"),
        case("compile_cp", "tiny-llama", "cp=2,zero=2,micro_batch=4,compile=1")],
    4: [case("hsdp", "tiny-gpt2", "dp=4,zero=3,shard_group=2,micro_batch=1"),
        case("pp_tp", "tiny-llama", "pp=2,tp=2,schedule=1f1b,micro_batch=2", L4),
        case("pp_fsdp", "tiny-llama", "pp=2,dp=2,zero=3,schedule=interleaved-1f1b,virtual_stages=2,micro_batch=1", L4),
        case("tp_fsdp", "tiny-llama", "tp=2,dp=2,zero=3,sequence_parallel=1,micro_batch=2"),
        case("tp_ddp", "tiny-llama", "tp=2,dp=2,zero=0,micro_batch=2"),
        case("cp_fsdp", "tiny-llama", "cp=2,dp=2,zero=3,micro_batch=2,offload_params=1,offload_optimizer=1"),
        case("cp_tp_sp", "tiny-llama", "cp=2,tp=2,sequence_parallel=1,micro_batch=4"),
        case("ep_fsdp", "tiny-moe", "dp=4,ep=2,zero=3,micro_batch=1"),
        case("ep_hsdp", "tiny-moe", "dp=4,ep=2,zero=3,shard_group=2,micro_batch=1"),
        case("ep_tp_fsdp", "tiny-moe", "dp=2,ep=2,tp=2,zero=3,micro_batch=2"),
        case("ep_pp_ddp", "tiny-moe", "pp=2,dp=2,ep=2,schedule=1f1b,micro_batch=2")],
    8: [case("pp_tp_fsdp", "tiny-llama", "pp=2,tp=2,dp=2,zero=3,sequence_parallel=1,schedule=1f1b,micro_batch=1", L4)],
}
ALL = [(n, c["name"]) for n, cs in CASES.items() for c in cs]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    return {n: torchrun_worker(tmp_path_factory.mktemp(f"parity{n}"), n, cs) for n, cs in CASES.items()}


@pytest.mark.parametrize("nproc,name", ALL, ids=[f"{n}p-{c}" for n, c in ALL])
def test_matches_single_process(results: dict[int, dict], nproc: int, name: str) -> None:
    ranks = results[nproc][name]
    log = results[nproc]["__log__"][0]
    assert len(ranks) == nproc, f"{len(ranks)}/{nproc} ranks reported; torchrun rc={log['rc']}\n{log['stderr']}"
    for r in ranks:
        assert r["ok"], f"rank {r['rank']}: {r.get('error')}\n{r.get('trace', '')[-2000:]}"
        assert r["loss_rel_err"] < TOL, (r["rank"], r["losses"], r["ref_losses"])
        assert r["grad_norm_rel_err"] < TOL, (r["rank"], r["norms"], r["ref_norms"])
        assert r["weight_rel_err"] < TOL, (r["rank"], r["worst"])
        assert r["noise_param_abs_err"] < 1e-2, r["rank"]
        assert not r["unknown_params"], r["unknown_params"]
    held = set().union(*(r["params"] for r in ranks))  # pipeline stages (experts) together hold every parameter
    assert held == set(ranks[0]["ref_params"])


def test_cpu_notes(results: dict[int, dict]) -> None:
    """Offload on CPU is a no-op, said once per run (and recorded by `meshplan train`)."""
    notes = results[4]["cp_fsdp"][0]["notes"]
    assert len(notes) == 1 and "offload: no-op on CPU" in notes[0], notes
    assert results[2]["compile_cp"][0]["notes"] == []
