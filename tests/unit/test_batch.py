"""estimate_batch over many mixed plans equals estimate() of each plan alone."""
from __future__ import annotations

import random

import numpy as np
import pytest

from meshplan.cost import estimate
from meshplan.cost.batch import estimate_batch, plans_to_columns
from meshplan.spec.constraints import violations
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import Plan, Workload


def _random_plans(model, cluster, work, n, seed):
    rng, out, N = random.Random(seed), [], cluster.num_gpus
    while len(out) < n:
        tp, cp, pp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2]), rng.choice([1, 2, 4, 3])
        if N % (tp * cp * pp):
            continue
        sched = rng.choice(["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv"])
        v = {"interleaved-1f1b": rng.choice([1, 2]), "zbv": 2}.get(sched, 1)
        rec = rng.choice(["none", "selective", "op", "full"])
        kw = dict(tp=tp, pp=pp, dp=N // (tp * cp * pp), cp=cp, micro_batch=rng.choice([1, 2]),
                  virtual_stages=v, schedule=sched, recompute=rec, zero=rng.choice([0, 1, 2, 3]),
                  sequence_parallel=tp > 1 and rng.random() < 0.5, compile=rng.random() < 0.5,
                  flash_attention=rng.random() < 0.8, fused_loss=rng.random() < 0.3,
                  async_tp=rng.random() < 0.3, offload_optimizer=rng.random() < 0.1,
                  recompute_layers=rng.choice([None, 1]) if rec == "full" else None)
        L = model.num_layers
        if L % (pp * v):
            if v > 1:
                continue
            kw["stage_layers"] = tuple(L // pp + (i < L % pp) for i in range(pp))
        plan = Plan(**kw)
        if not violations(model, cluster, plan, work):
            out.append(plan)
    return out


@pytest.mark.parametrize("mname,cname,B,s", [("llama3-8b", "h100-sxm-80gb:16", 64, 4096),
                                             ("gpt3-175b", "a100-sxm-80gb:96", 96, 2048),
                                             ("mixtral-8x7b", "h100-sxm-80gb:32", 64, 4096)])
def test_batch_rows_equal_single_estimates(mname, cname, B, s):
    m, c, w = load_model(mname), load_cluster(cname), Workload(global_batch=B, seq_len=s)
    plans = _random_plans(m, c, w, 120, seed=hash(mname) % 1000)
    r = estimate_batch(m, c, w, plans_to_columns(plans))
    for i, plan in enumerate(plans):
        one = estimate(m, c, plan, w)
        assert r["step_time_s"][i] == pytest.approx(one.step_time_s, rel=1e-12)
        assert r["peak_memory_gib"][i] == pytest.approx(one.peak_memory_gib, rel=1e-12)
        assert bool(r["fits"][i]) == one.fits
        for k, v in one.time.items():
            assert r[f"time.{k}"][i] == pytest.approx(v, rel=1e-12, abs=1e-15)
    assert np.all(np.isfinite(r["step_time_s"]))
