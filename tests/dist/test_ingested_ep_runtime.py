"""Expert parallelism on ingested MoE models (issue 29): ``ep=2`` on 2 processes and ``ep=2,tp=2``
(and ``ep=2,pp=2``) on 4 (torchrun, gloo, fp32) against one process, through ingested_worker.py:
per-step losses and gradient norms and the final weights against the float64 run from the same
initial weights, within test_parity.check_errors' bound (FACTOR x the error of correct
single-process fp32 runs), and the losses within 1e-5 (relative) of the single-process fp32 run
on the same global batch (the issue's done-when).

Families: HF Mixtral (fused experts), Qwen2-MoE (fused experts beside a gated shared expert),
DeepSeek-V2 (shared experts, fine-grained routed experts, group-limited greedy routing, a dense
first layer), DeepSeek-V3 (sigmoid scores with the correction bias, group-limited top-k,
renormalised and scaled weights) and a hand-written ``nn.ModuleList`` of experts with a top-k gate
(tests/data/modules/list_moe.py). Plus: ZeRO-3 (experts FSDP-sharded over their replicas) and a
pipeline beside EP, the refusals (ep not dividing the experts, a model without experts), and a
checkpoint saved under ``dp=2,ep=2`` (fused experts as chunks of the whole tensors) resumed under
``dp=2`` and one process against the uninterrupted run.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ROOT, meshplan_train, run_env, torchrun_worker
from test_ingested import HF, MODULES, WORKER, check_weights
from test_parity import check_errors

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SOURCES = {"mixtral": f"hf:{HF / 'mixtral-tiny.json'}", "qwen_moe": f"hf:{HF / 'qwen2-moe-tiny.json'}",
           "deepseek_v2": f"hf:{HF / 'deepseek-v2-tiny.json'}", "deepseek_v3": f"hf:{HF / 'deepseek-v3-tiny.json'}",
           "list": "module:list_moe:make_list_moe"}
BATCH, STEPS, SEQ = 4, 3, 16
LOSS_PARITY = 1e-5
"""Relative difference of each step's loss from one process (fp32, the same global batch)."""
TWO = [("mixtral_ep", "mixtral", "dp=2,ep=2,micro_batch=1"),  # 2 micro-batches per replica
       ("qwen_moe_ep", "qwen_moe", "dp=2,ep=2,micro_batch=2"),
       ("deepseek_v2_ep", "deepseek_v2", "dp=2,ep=2,micro_batch=2"),
       ("deepseek_v3_ep", "deepseek_v3", "dp=2,ep=2,micro_batch=2"),
       ("list_ep", "list", "dp=2,ep=2,micro_batch=2"),
       ("mixtral_ep_zero3", "mixtral", "dp=2,ep=2,zero=3,micro_batch=1")]
FOUR = [("mixtral_ep_tp", "mixtral", "tp=2,dp=2,ep=2,micro_batch=2"),
        ("list_ep_tp", "list", "tp=2,dp=2,ep=2,micro_batch=2"),
        ("qwen_moe_ep_tp", "qwen_moe", "tp=2,dp=2,ep=2,micro_batch=2"),
        ("mixtral_ep_pp", "mixtral", "pp=2,dp=2,ep=2,micro_batch=1,schedule=1f1b")]


def modules_env() -> dict[str, str]:
    return run_env(PYTHONPATH=f"{MODULES}:{ROOT / 'src'}")


def case(name: str, fam: str, plan: str) -> dict:
    return {"name": name, "source": SOURCES[fam], "plan": plan + ",precision=fp32", "global_batch": BATCH,
            "steps": STEPS, "seq_len": SEQ}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    return torchrun_worker(tmp_path_factory.mktemp("ep2"), 2, [case(*c) for c in TWO], WORKER, modules_env())


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    return torchrun_worker(tmp_path_factory.mktemp("ep4"), 4, [case(*c) for c in FOUR], WORKER, modules_env())


def check(results: dict[str, list[dict]], name: str, nproc: int) -> None:
    ranks = results[name]
    log = results["__log__"][0]
    assert len(ranks) == nproc, f"{len(ranks)}/{nproc} ranks reported; torchrun rc={log['rc']}\n{log['stderr']}"
    for r in ranks:
        assert r["ok"], f"rank {r['rank']}: {r.get('error')}\n{r.get('trace', '')[-2000:]}"
        assert r["exact_fp32_ops"] == [] and r["exact_spread"] < 1e-12, (r["exact_fp32_ops"], r["exact_spread"])
        for got, ref in zip(r["losses"], r["ref_losses"]):
            assert abs(got - ref) <= LOSS_PARITY * abs(ref), (name, r["losses"], r["ref_losses"])
        check_errors(f"{name} rank {r['rank']} losses", r["losses"], r["single_losses"], r["exact_losses"])
        check_errors(f"{name} rank {r['rank']} gradient norms", r["norms"], r["single_norms"], r["exact_norms"])
        check_weights(r)
        assert not r["unknown_params"], r["unknown_params"]
    # every expert's final weights came back (full_weights gathers them from the ep group)
    held = set().union(*(r["params"] for r in ranks))
    assert held == set(ranks[0]["ref_params"])
    # and the experts were split: fused ones hold half their rows (ep=2), a list's half its experts
    for r in ranks:
        if name.startswith("list"):
            experts = {k for k in r["local_params"] if ".experts." in k}
            assert experts and len(experts) * 2 == len({k for k in r["ref_params"] if ".experts." in k}), experts
        else:
            halves = {2 * first // rows for rows, first in r["expert_rows"].values()}
            assert len(halves) == 1, r["expert_rows"]  # one ep rank: the same half of every layer
    if not name.startswith("list"):  # both halves held, by the two ep ranks
        assert {2 * f // n for r in ranks for n, f in r["expert_rows"].values()} == {0, 1}


@pytest.mark.parametrize("name", [n for n, _, _ in TWO])
def test_ep2_matches_one_process(two: dict[str, list[dict]], name: str) -> None:
    check(two, name, 2)


@pytest.mark.parametrize("name", [n for n, _, _ in FOUR])
def test_ep2_tp2_matches_one_process(four: dict[str, list[dict]], name: str) -> None:
    check(four, name, 4)


def test_train_cli_ep_and_refusals() -> None:
    """`meshplan train` end to end under ep=2 (the pre-flight passes, both ranks train), and the
    one-line refusals before any rank starts: ep not dividing the experts, ep on a model without."""
    ok = meshplan_train("--model", SOURCES["qwen_moe"], "--plan", "dp=2,ep=2,precision=fp32", "--global-batch", "4",
                        "--steps", "2", "--seq-len", "16", "--nproc-per-node", "2", env=modules_env())
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "step     2/2" in ok.stdout + ok.stderr, ok.stderr[-3000:]
    bad = meshplan_train("--model", SOURCES["mixtral"], "--plan", "dp=8,ep=8,precision=fp32", "--steps", "1",
                         "--seq-len", "16", "--nproc-per-node", "8", env=modules_env())
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "ep=8" in bad.stderr and "4" in bad.stderr, bad.stderr
    dense = meshplan_train("--model", f"hf:{HF / 'llama-tiny.json'}", "--plan", "dp=2,ep=2,precision=fp32",
                           "--steps", "1", "--seq-len", "16", "--nproc-per-node", "2", env=modules_env())
    assert dense.returncode != 0 and "Traceback" not in dense.stderr
    assert "no experts" in dense.stderr, dense.stderr


CKPT_TOL = 1e-5
"""Relative difference of a resumed run's losses and final weights from the uninterrupted one (fp32:
the layouts differ only in summation order, as test_train_cli's resume checks)."""


def test_checkpoint_under_ep_resumes_under_other_layouts(tmp_path: Path) -> None:
    """`meshplan train --checkpoint-dir` with HF fused experts under dp=2,ep=2 (it used to be refused):
    each rank saves its rows of the [E, ...] expert tensors (and their AdamW state) as chunks at its
    offset. The checkpoint holds the whole tensors, and resumed under dp=2 (ep=1) and under one process
    it continues the uninterrupted dp=2,ep=2 run: the same losses and final weights."""
    import shutil

    from test_train_cli import final_weights, losses

    base = ["--model", SOURCES["mixtral"], "--global-batch", "4", "--seq-len", "16", "--pg-timeout", "60"]
    ep_plan = "dp=2,ep=2,micro_batch=1,precision=fp32"

    def train(name: str, plan: str, steps: int, nproc: int, ck: Path, *extra: str) -> dict[int, float]:
        m = tmp_path / f"{name}.jsonl"
        p = meshplan_train(*base, "--plan", plan, "--steps", str(steps), "--nproc-per-node", str(nproc),
                           "--checkpoint-dir", str(ck), "--metrics", str(m), *extra, env=modules_env())
        assert p.returncode == 0, p.stderr[-4000:]
        assert "Traceback" not in p.stderr
        return losses(m)

    want = train("continuous", ep_plan, 4, 2, tmp_path / "continuous")
    train("first", ep_plan, 2, 2, tmp_path / "saved")
    saved = final_weights(tmp_path / "saved")
    experts = [k for k in saved if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 2 * 3, sorted(saved)  # 3 layers
    assert all(saved[k].shape[0] == 4 for k in experts)  # all 4 experts' rows, from both ep ranks
    for k in experts:  # each rank's half is its own rows, not a copy of the other's
        assert not torch.equal(saved[k][:2], saved[k][2:]), k
    ref = final_weights(tmp_path / "continuous")
    for name, plan, nproc in (("dp2", "dp=2,micro_batch=1,precision=fp32", 2),
                              ("one", "micro_batch=2,precision=fp32", 1)):
        ck = tmp_path / f"resume-{name}"
        shutil.copytree(tmp_path / "saved", ck)
        got = train(name, plan, 4, nproc, ck, "--resume")
        assert sorted(got) == [3, 4], got
        for step in (3, 4):
            assert abs(got[step] - want[step]) <= CKPT_TOL * abs(want[step]), (name, step, got, want)
        w = final_weights(ck)
        assert set(w) == set(ref)
        for k in ref:
            err = float((w[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12))
            assert err < CKPT_TOL, (name, k, err)
