"""The optimizer as a workload field and the model-state bytes (issue 27, items 3 and 4).

State bytes per parameter and step bytes per optimizer (cost.memory.OPTIMIZER_STATE_BYTES,
OPTIMIZER_STEP_BYTES), how ZeRO shards them, the optimizer through the CLI and plan files, the
exports; precision=fp32's model states (cause 4) and the ZeRO level with nothing to shard
(cause 5), with hypothesis properties: with dp = 1 the ZeRO level changes no memory, fp32 doubles
the 16-bit weights and gradients and drops the master copy, and memory is monotone in micro-batch,
sequence length and layers per stage.
"""
from __future__ import annotations

import json
import math

import pytest
from clirun import error_line, run
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from meshplan.cost import estimate
from meshplan.cost.memory import (
    ADAMW,
    OPTIMIZER_STATE_BYTES,
    OPTIMIZER_STEP_BYTES,
    adafactor_state_bytes,
    adafactor_state_elements,
    optimizer_cost,
    transformer_param_shapes,
)
from meshplan.cost.params import DEFAULT_PARAMS
from meshplan.cost.profile import PROFILES
from meshplan.errors import MeshplanError
from meshplan.export import ExportInput, export
from meshplan.spec.constraints import violations
from meshplan.spec.io import load_model, parse_cluster_shorthand
from meshplan.spec.plan import OPTIMIZERS, Plan, Workload
from meshplan.spec.transformer import as_graph
from meshplan.units import GiB

SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
REL = 1e-9
STATES = ("weights", "grads", "optimizer")


def states(r) -> dict[str, float]:
    return {k: r.memory[k] * GiB for k in STATES}


def params_per_gpu(model, plan) -> float:
    return model.num_params() / (plan.tp * plan.pp)


# ---- state bytes, step bytes, sharding -----------------------------------------------------------

@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_each_optimizers_state_bytes_and_how_zero_shards_them(opt):
    """One GPU, bf16: optimizer part = (fp32 master 4 + the optimizer's S) x P; fp32: S x P (no
    master); ZeRO-1 over 8 ranks shards all of it, ZeRO-3 shards the states (the master is the fp32
    sharded weights)."""
    m = load_model("gpt3-350m")
    g, P = as_graph(m, m.seq_len), m.num_params()
    S = optimizer_cost(opt, g).state_bytes
    if OPTIMIZER_STATE_BYTES[opt] is not None:
        assert S == OPTIMIZER_STATE_BYTES[opt]
    one = parse_cluster_shorthand("a100-sxm-80gb:1")
    eight = parse_cluster_shorthand("a100-sxm-80gb:8")
    work = Workload(global_batch=8, seq_len=m.seq_len, optimizer=opt)
    assert states(estimate(m, one, Plan(micro_batch=1), work))["optimizer"] == pytest.approx((4 + S) * P, rel=REL)
    fp32 = states(estimate(m, one, Plan(micro_batch=1, precision="fp32"), work))
    assert fp32["optimizer"] == pytest.approx(S * P, rel=REL)
    z1 = states(estimate(m, eight, Plan(dp=8, zero=1, micro_batch=1), work))
    assert z1["optimizer"] == pytest.approx((4 + S) * P / 8, rel=REL)
    z3 = states(estimate(m, eight, Plan(dp=8, zero=3, micro_batch=1), work))
    assert z3["optimizer"] == pytest.approx(S * P / 8, rel=REL) and z3["weights"] == pytest.approx(4 * P / 8, rel=REL)


def test_state_bytes_order_and_values():
    """AdamW 8 = Adam > SGD = Lion 4 > 8-bit Adam ~2.03 > Adafactor (factored: ~8 / hidden)."""
    m = load_model("llama3-8b")
    g = as_graph(m, 1024)
    s = {o: optimizer_cost(o, g).state_bytes for o in OPTIMIZERS}
    assert s["adamw"] == s["adam"] == 8.0 and s["sgd"] == s["lion"] == 4.0
    assert s["adam8bit"] == pytest.approx(2.0 + 2 * 4.0 / 256)
    assert 0 < s["adafactor"] < 8 * 4.0 / m.hidden_size  # 4 (rows + cols) per matrix, plus the norms' full variance
    assert optimizer_cost("adamw") is ADAMW


def test_adafactor_state_counts_as_torch_keeps_it():
    """torch.optim.Adafactor: a matrix its row and column factors, a vector its full variance; a
    generated graph's count from the parameter shapes the runtime builds."""
    assert adafactor_state_elements([(6, 4), (4,), (2, 3, 5)]) == (6 + 4) + 4 + 2 * (3 + 5)
    for name in ("tiny-llama", "tiny-gpt2", "tiny-moe", "mixtral-8x7b"):
        m = load_model(name)
        shapes = transformer_param_shapes(m)
        assert sum(math.prod(s) for s in shapes) == m.num_params(), name
        assert adafactor_state_bytes(as_graph(m, m.seq_len)) == 4.0 * adafactor_state_elements(shapes) / m.num_params()


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_optimizer_step_time_is_its_bytes_over_hbm(opt):
    """The step's time scales with the bytes it moves per parameter (AdamW's 32 the calibrated
    CostParams.optimizer_bytes_per_param); on the host (offload) with the same ratio."""
    m, c = load_model("gpt3-1.3b"), parse_cluster_shorthand("a100-sxm-80gb:8")
    plan = Plan(dp=8, zero=1, micro_batch=1)
    t = {o: estimate(m, c, plan, Workload(global_batch=8, seq_len=2048, optimizer=o)).time["optimizer"]
         for o in ("adamw", opt)}
    want = (DEFAULT_PARAMS.optimizer_bytes_per_param + OPTIMIZER_STEP_BYTES[opt] - 32.0) / 32.0
    assert t[opt] / t["adamw"] == pytest.approx(want, rel=1e-9)


def test_default_workload_is_adamw_and_bit_identical():
    m, c = load_model("llama3-8b"), parse_cluster_shorthand("h100-sxm-80gb:8")
    plan = Plan(tp=2, dp=4, zero=1, micro_batch=1)
    a = estimate(m, c, plan, Workload(global_batch=8, seq_len=4096))
    b = estimate(m, c, plan, Workload(global_batch=8, seq_len=4096, optimizer="adamw"))
    assert a.to_dict() == b.to_dict()


def test_sub_workloads_keep_the_optimizer():
    """A length distribution's per-length estimates price the workload's optimizer, not AdamW."""
    from meshplan.spec.lengths import parse_lengths
    m, c = load_model("gpt3-350m"), parse_cluster_shorthand("a100-sxm-80gb:8")
    plan = Plan(dp=8, zero=1, micro_batch=1)
    d = parse_lengths("512:0.5,1024:0.5", "padded")
    r = {o: estimate(m, c, plan, Workload.of(16, d, o)) for o in ("adamw", "sgd")}
    assert r["sgd"].memory["optimizer"] < r["adamw"].memory["optimizer"]
    assert r["sgd"].time["optimizer"] < r["adamw"].time["optimizer"]


def test_unknown_optimizer_is_a_clear_error():
    with pytest.raises(MeshplanError, match="optimizer must be one of adamw, adam, sgd"):
        Workload(global_batch=8, seq_len=128, optimizer="adagrad")


# ---- cause 4: precision=fp32 ----------------------------------------------------------------------

def test_cause4_fp32_gives_fp32_model_states_and_no_master_copy():
    """Issue 27 cause 4: dp=8, zero=2, precision=fp32 reports 4 B/param weights and grads (grads
    sharded by ZeRO-2) and only AdamW's moments (no separate master copy)."""
    m, c = load_model("gpt3-350m"), parse_cluster_shorthand("a100-sxm-80gb:8")
    P = m.num_params()
    s = states(estimate(m, c, Plan(dp=8, zero=2, micro_batch=1, precision="fp32"), Workload(global_batch=8,
                                                                                               seq_len=1024)))
    assert s["weights"] == pytest.approx(4 * P, rel=REL)
    assert s["grads"] == pytest.approx(4 * P / 8, rel=REL)
    assert s["optimizer"] == pytest.approx(8 * P / 8, rel=REL)


# ---- cause 5: nothing to shard ----------------------------------------------------------------------

@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_cause5_zero_level_changes_no_memory_on_one_gpu(profile):
    """Issue 27 cause 5: a GPT on one GPU: ZeRO 0, 1, 2 and 3 give the same memory, part by part
    (no profile documents extra flat buffers for a ZeRO stage)."""
    m, c = load_model("gpt3-1.3b"), parse_cluster_shorthand("a100-sxm-80gb:1")
    p = PROFILES[profile].apply(DEFAULT_PARAMS)
    work = Workload(global_batch=4, seq_len=2048)
    mems = [estimate(m, c, Plan(zero=z, micro_batch=1), work, p).memory for z in (0, 1, 2, 3)]
    for mem in mems[1:]:
        assert mem == pytest.approx(mems[0], rel=REL)


# ---- properties ---------------------------------------------------------------------------------------

@st.composite
def one_replica(draw):
    """(model, cluster, plan, workload) with dp x cp = 1: tp and pp only."""
    base = load_model(draw(st.sampled_from(("llama3-8b", "gpt3-1.3b", "mixtral-8x7b"))))
    heads = base.num_attention_heads
    pp = draw(st.sampled_from((1, 2)))
    model = base.replace(name="random", num_layers=pp * draw(st.integers(1, 6)),
                         seq_len=draw(st.sampled_from((512, 1024, 2048))))
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if heads % t == 0 and base.kv_heads % t == 0]))
    mb = draw(st.sampled_from((1, 2)))
    m = draw(st.integers(1, 4)) * pp
    cluster = parse_cluster_shorthand(f"h100-sxm-80gb:{tp * pp}")
    plan = Plan(tp=tp, pp=pp, micro_batch=mb, sequence_parallel=tp > 1,
                precision=draw(st.sampled_from(("bf16", "fp16", "fp32"))),
                recompute=draw(st.sampled_from(("none", "selective", "full"))))
    work = Workload(global_batch=mb * m, seq_len=model.seq_len, optimizer=draw(st.sampled_from(OPTIMIZERS)))
    assume(not violations(model, cluster, plan, work))
    profile = draw(st.sampled_from(sorted(PROFILES)))
    return model, cluster, plan, work, PROFILES[profile].apply(DEFAULT_PARAMS)


@SETTINGS
@given(one_replica())
def test_with_one_replica_the_zero_level_changes_no_memory(case):
    """dp = 1: nothing to shard; every ZeRO level the plan allows has ZeRO-0's memory, part by part,
    per stage, and the host memory (no profile documents a ZeRO stage's flat buffers)."""
    model, cluster, plan, work, p = case
    base = estimate(model, cluster, plan, work, p)
    for z in (1, 2, 3):
        q = plan.replace(zero=z)
        if violations(model, cluster, q, work):
            continue
        r = estimate(model, cluster, q, work, p)
        assert r.memory == pytest.approx(base.memory, rel=REL), (z, plan.short())
        assert r.memory_per_stage == pytest.approx(base.memory_per_stage, rel=REL), (z, plan.short())
        assert r.host_memory_gib == pytest.approx(base.host_memory_gib, rel=REL)


@st.composite
def sharded(draw):
    """A plan on 8 GPUs of a GPT or Llama, any ZeRO level, bf16 (its fp32 twin is compared)."""
    model = load_model(draw(st.sampled_from(("llama3-8b", "gpt3-1.3b", "gpt3-350m"))))
    tp = draw(st.sampled_from((1, 2)))
    dp = 8 // tp
    zero = draw(st.sampled_from((0, 1, 2, 3)))
    plan = Plan(tp=tp, dp=dp, zero=zero, micro_batch=1, sequence_parallel=tp > 1)
    work = Workload(global_batch=dp * draw(st.integers(1, 3)), seq_len=1024,
                    optimizer=draw(st.sampled_from(OPTIMIZERS)))
    return model, parse_cluster_shorthand("a100-sxm-80gb:8"), plan, work


@SETTINGS
@given(sharded())
def test_fp32_doubles_the_16_bit_model_states_and_drops_the_master(case):
    """precision=fp32 against bf16 (meshplan's profile: 16-bit gradients without a distributed
    optimizer): weights and gradients that bf16 keeps in 16 bits double; those bf16 keeps in fp32
    (ZeRO-3's sharded weights and gradients, ZeRO-1/2's fp32 gradients) stay; the optimizer part
    loses exactly the 4-byte master copy. Where the bf16 plan keeps no separate master (ZeRO-3:
    the fp32 shards are the master) the optimizer part is the same."""
    model, cluster, plan, work = case
    b = states(estimate(model, cluster, plan, work))
    f = states(estimate(model, cluster, plan.replace(precision="fp32"), work))
    n = params_per_gpu(model, plan)
    shard = plan.dp if plan.zero >= 1 else 1
    if plan.zero == 3:
        assert f == pytest.approx(b, rel=REL)
        return
    assert f["weights"] == pytest.approx(2 * b["weights"], rel=REL)
    grads16 = plan.zero == 0
    assert f["grads"] == pytest.approx((2 if grads16 else 1) * b["grads"], rel=REL)
    assert b["optimizer"] - f["optimizer"] == pytest.approx(4 * n / shard, rel=1e-6)


@st.composite
def any_plan(draw):
    base = load_model(draw(st.sampled_from(("llama3-8b", "gpt3-1.3b"))))
    model = base.replace(name="random", num_layers=4 * draw(st.integers(1, 3)))
    tp = draw(st.sampled_from((1, 2)))
    pp = draw(st.sampled_from((1, 2, 4)))
    dp = 8 // (tp * pp)
    zero = draw(st.sampled_from((0, 1) if pp > 1 else (0, 1, 2, 3)))
    plan = Plan(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=1, sequence_parallel=tp > 1,
                schedule=draw(st.sampled_from(("gpipe", "1f1b"))) if pp > 1 else "1f1b",
                recompute=draw(st.sampled_from(("none", "selective", "full"))),
                precision=draw(st.sampled_from(("bf16", "fp32"))))
    work = Workload(global_batch=dp * pp * 4, seq_len=draw(st.sampled_from((512, 1024))),
                    optimizer=draw(st.sampled_from(OPTIMIZERS)))
    return model, parse_cluster_shorthand("a100-sxm-80gb:8"), plan, work


def _peak(model, cluster, plan, work) -> float:
    assume(not violations(model, cluster, plan, work))
    return estimate(model, cluster, plan, work).peak_memory_gib


@SETTINGS
@given(any_plan())
def test_memory_is_monotone_in_micro_batch_sequence_length_and_layers_per_stage(case):
    model, cluster, plan, work = case
    peak = _peak(model, cluster, plan, work)
    assert _peak(model, cluster, plan.replace(micro_batch=2), work) >= peak * (1 - REL)
    longer = Workload(global_batch=work.global_batch, seq_len=2 * work.seq_len, optimizer=work.optimizer)
    assert _peak(model.replace(seq_len=2 * work.seq_len), cluster, plan, longer) >= peak * (1 - REL)
    deeper = model.replace(num_layers=model.num_layers + plan.pp)  # one more layer on every stage
    assert _peak(deeper, cluster, plan, work) >= peak * (1 - REL)


# ---- the command line, plan files, exports ------------------------------------------------------------

PLAN = ["--model", "gpt3-350m", "--cluster", "a100-sxm-80gb:8", "--global-batch", "16", "--seq-len", "1024"]


def test_optimizer_on_estimate_and_simulate(capsys):
    rc, out, err = run(capsys, "estimate", *PLAN, "--plan", "dp=8,zero=1", "--optimizer", "sgd", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["optimizer"] == "sgd"
    rc, out, err = run(capsys, "estimate", *PLAN, "--plan", "dp=8,zero=1", "--json")
    assert json.loads(out)["memory"]["optimizer"] > d["memory"]["optimizer"]
    rc, out, err = run(capsys, "simulate", *PLAN, "--plan", "dp=8,zero=1", "--optimizer", "lion", "--json")
    assert rc == 0, err
    assert json.loads(out)["optimizer"] == "lion"
    error_line(capsys, ["estimate", *PLAN, "--plan", "dp=8", "--optimizer", "adagrad"])


def test_plan_files_record_the_optimizer(capsys, tmp_path):
    out = tmp_path / "p.json"
    rc, _, err = run(capsys, "plan", *PLAN, "--optimizer", "adafactor", "--out", str(out), "--top", "1")
    assert rc == 0, err
    doc = json.loads(out.read_text())
    assert doc["optimizer"] == "adafactor"
    rc, text, err = run(capsys, "estimate", "--plan", str(out), "--json")
    assert rc == 0, err
    d = json.loads(text)
    assert d["optimizer"] == "adafactor" and d["step_time_s"] == doc["predicted"]["step_time_s"]
    line = error_line(capsys, ["estimate", "--plan", str(out), "--optimizer", "adamw"])
    assert "--optimizer adamw disagrees with the plan file's adafactor" in line and "--override" in line
    rc, text, err = run(capsys, "estimate", "--plan", str(out), "--optimizer", "adamw", "--override", "--json")
    assert rc == 0 and json.loads(text)["optimizer"] == "adamw" and "--override" in err
    doc["optimizer"] = "rmsprop"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    assert "'optimizer' must be one of" in error_line(capsys, ["estimate", "--plan", str(bad)])


def test_train_refuses_the_optimizers_it_does_not_run(capsys):
    line = error_line(capsys, ["train", "--model", "tiny-llama", "--plan", "dp=1", "--steps", "1",
                               "--optimizer", "lion"])
    assert "meshplan train runs adamw, sgd, adafactor" in line and "lion is planned and priced" in line


@pytest.mark.parametrize("target,opt,written", [
    ("deepspeed", "adafactor", "Adafactor"), ("deepspeed", "lion", "Lion"), ("deepspeed", "sgd", "SGD"),
    ("torchtitan", "adam", "Adam"), ("megatron", "sgd", "sgd"),
])
def test_export_writes_the_optimizer_where_the_target_has_it(target, opt, written):
    r = export(target, ExportInput(plan=Plan(dp=8), model=load_model("llama3-8b"), global_batch=16,
                                        seq_len=2048, optimizer=opt))
    assert not [u for u in r.unsupported if "optimizer" in u]
    text = json.dumps(r.config)
    assert written in text


@pytest.mark.parametrize("target,opt", [("deepspeed", "adam8bit"), ("torchtitan", "lion"), ("torchtitan", "sgd"),
                                        ("megatron", "adafactor"), ("megatron", "lion")])
def test_export_lists_an_optimizer_the_target_cannot_set(target, opt):
    r = export(target, ExportInput(plan=Plan(dp=8), model=load_model("llama3-8b"), global_batch=16,
                                        seq_len=2048, optimizer=opt))
    assert any(u.startswith(f"optimizer={opt}:") for u in r.unsupported), r.unsupported
