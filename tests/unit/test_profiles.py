"""Implementation profiles (meshplan.cost.profile): built-in profiles, profile files, the
kernels and buffers they choose, and how validate reads framework and attention_impl."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplan.cost import estimate
from meshplan.cost.compute import ATTENTION_KERNELS, FLASH_KERNELS, attention_seconds
from meshplan.cost.params import DEFAULT_PARAMS
from meshplan.cost.profile import (
    DEFAULT_PROFILE,
    PROFILE_FIELDS,
    PROFILES,
    Profile,
    get_profile,
    profile_for_framework,
)
from meshplan.errors import MeshplanError
from meshplan.spec.io import load_cluster, load_model
from meshplan.spec.plan import Plan, Workload
from meshplan.spec.transformer import block_ops
from meshplan.validate.plans import attention_kernel
from meshplan.validate.runs import case_from_row

NAMES = ("megatron", "megatron-deepspeed", "deepspeed", "torchtitan", "llm-foundry", "hf-accelerate", "nanotron",
         "meshplan")


def _case(gpu: str = "h100-sxm-80gb", **plan: object):
    m = load_model("llama3-8b").replace(num_layers=4)
    cluster = load_cluster(f"{gpu}:8")
    p = Plan(**{"dp": 8, "micro_batch": 1, **plan})
    return m, cluster, p, Workload(global_batch=16, seq_len=4096)


def test_built_in_profiles_and_default():
    assert DEFAULT_PROFILE == "meshplan" and get_profile(None) is PROFILES["meshplan"]
    for name in NAMES:
        prof = get_profile(name)
        assert isinstance(prof, Profile) and prof.name == name
        p = prof.apply(DEFAULT_PARAMS)
        assert set(prof.overrides) <= set(PROFILE_FIELDS)
        lines = prof.describe()
        assert len(lines) == len(PROFILE_FIELDS) and lines[0].startswith("attention: ")
        assert p.attention_kernel in ATTENTION_KERNELS
        # every setting a built-in profile makes cites the codebase default it follows
        assert set(prof.sources) == set(prof.overrides)


def test_meshplan_profile_keeps_the_default_numbers():
    for plan in ({}, {"zero": 3}, {"zero": 1, "compile": True}, {"tp": 2, "dp": 4, "fused_loss": True}):
        case = _case(**plan)
        a = estimate(*case)
        b = estimate(*case, get_profile(None).apply(DEFAULT_PARAMS))
        assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)
        assert a.peak_memory_gib == pytest.approx(b.peak_memory_gib, rel=1e-12)


def test_unknown_profile_and_profile_files(tmp_path):
    with pytest.raises(MeshplanError, match="unknown profile") as e:
        get_profile("megatorn")
    assert "megatron" in str(e.value) + (e.value.hint or "")
    f = tmp_path / "mine.toml"
    f.write_text('label = "my stack"\nbase = "megatron"\n[settings]\nattention_kernel = "flash3"\ndp_overlap = true\n')
    prof = get_profile(str(f))
    assert prof.name == "mine" and prof.label == "my stack"
    p = prof.apply(DEFAULT_PARAMS)
    assert p.attention_kernel == "flash3" and p.dp_overlap and p.main_grads == "fp32"
    bad = {"atention_kernel = \"flash2\"\n": "did you mean 'attention_kernel'",
           "attention_kernel = \"flash9\"\n": "not understood",
           "dp_overlap = 3\n": "not true or false",
           "dp_bucket_mib = -1\n": "out of range",
           "dp_bucket_mib = \"big\"\n": "not a number",
           "base = \"nope\"\n": "not a built-in profile",
           "[other]\nx = 1\n": "unknown table",
           "attention_kernel = \n": "not valid TOML"}
    for text, msg in bad.items():
        f.write_text(text)
        with pytest.raises(MeshplanError, match=msg):
            get_profile(str(f))
    with pytest.raises(MeshplanError, match="not found"):
        get_profile(str(tmp_path / "missing.toml"))


def test_profile_for_framework():
    assert profile_for_framework("megatron") == "megatron"
    assert profile_for_framework("Megatron-Core") == "megatron"
    assert profile_for_framework("NeMo") == "nemo"
    assert profile_for_framework("Megatron-DeepSpeed") == "megatron-deepspeed"
    assert profile_for_framework("deepspeed") == "deepspeed"
    assert profile_for_framework("HF Trainer") == "hf-accelerate"
    assert profile_for_framework("accelerate") == "hf-accelerate"
    assert profile_for_framework("composer") == "llm-foundry"
    assert profile_for_framework("nanotron") == "nanotron"
    assert profile_for_framework("torchtitan") == "torchtitan"
    assert profile_for_framework("unknown") == DEFAULT_PROFILE


def test_attention_kernel_times_follow_the_published_ratios():
    att = block_ops(load_model("llama3-8b")).attention
    plan = Plan(dp=8)
    for gpu, fa3 in (("h100-sxm-80gb", 1.5), ("a100-sxm-80gb", 1.0)):
        g = load_cluster(f"{gpu}:8").gpu
        peak = g.peak("bf16")
        t = {k: attention_seconds(att, plan, 1, 4096, g, DEFAULT_PARAMS.replace(attention_kernel=k), peak)
             for k in ATTENTION_KERNELS}
        assert t["sdpa"][0] == pytest.approx(t["flash2"][0])
        assert t["flash1"][0] == pytest.approx(2 * t["flash2"][0])
        assert t["flash3"][0] == pytest.approx(t["flash2"][0] / fa3)
        assert t["eager"][0] > t["fused-softmax"][0] > t["flash2"][0]
        assert t["eager"][1] > t["fused-softmax"][1]
        assert all(x[2] == t["flash2"][2] for x in t.values())  # model FLOPs do not depend on the kernel
    # a plan without flash_attention runs the eager kernel unless the profile's is unfused
    g = load_cluster("h100-sxm-80gb:8").gpu
    no = plan.replace(flash_attention=False)
    e = attention_seconds(att, no, 1, 4096, g, DEFAULT_PARAMS, g.peak("bf16"))
    assert e == attention_seconds(att, plan, 1, 4096, g, DEFAULT_PARAMS.replace(attention_kernel="eager"),
                                  g.peak("bf16"))


def test_profile_choices_cost_time_and_memory():
    case = _case()
    base = estimate(*case)
    # hand-fused elementwise kernels cost what torch.compile does
    fused = estimate(*case, DEFAULT_PARAMS.replace(elementwise_kernels="hand-fused"))
    compiled = estimate(case[0], case[1], case[2].replace(compile=True), case[3])
    assert fused.step_time_s == pytest.approx(compiled.step_time_s) and fused.step_time_s < base.step_time_s
    # gradient sync not overlapped: more exposed data-parallel time
    no = estimate(*case, DEFAULT_PARAMS.replace(dp_overlap=False))
    assert no.time["dp_comm"] > base.time["dp_comm"]
    # Megatron's fp32 main grads under DDP: 18 B/param of model states
    meg = estimate(*case, DEFAULT_PARAMS.replace(main_grads="fp32"))
    assert meg.memory["grads"] == pytest.approx(2 * base.memory["grads"])
    # the loss: 16-bit logits < fp32 upcast; chunked < fused < torch
    mem = {k: estimate(*case, DEFAULT_PARAMS.replace(loss_kernel=k)).peak_memory_gib
           for k in ("torch", "inplace", "fused", "chunked")}
    assert mem["chunked"] < mem["fused"] < mem["inplace"] < mem["torch"]
    assert estimate(*case, DEFAULT_PARAMS.replace(logits_fp32=False)).peak_memory_gib < mem["torch"]
    # optimizer temporaries, CUDA context, NCCL buffers never lower the peak
    for k, v in (("optimizer_temp_bytes", 4.0), ("cuda_context_gib", 0.5), ("nccl_buffer_gib", 0.5),
                 ("dp_bucket_buffers", 4.0)):
        assert estimate(*case, DEFAULT_PARAMS.replace(**{k: v})).peak_memory_gib >= base.peak_memory_gib


SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(profile=st.sampled_from(sorted(PROFILES)), zero=st.sampled_from((0, 1, 2, 3)), tp=st.sampled_from((1, 2)),
       recompute=st.sampled_from(("none", "selective", "full")), compile_=st.booleans(), fused_loss=st.booleans(),
       gpu=st.sampled_from(("a100-sxm-80gb", "h100-sxm-80gb")),
       kernel=st.sampled_from((None, *ATTENTION_KERNELS)))
def test_every_profile_gives_non_negative_terms_and_monotone_attention_memory(profile, zero, tp, recompute, compile_,
                                                                               fused_loss, gpu, kernel):
    params = get_profile(profile).apply(DEFAULT_PARAMS)
    if kernel is not None:
        params = params.replace(attention_kernel=kernel)
    m, cluster, plan, work = _case(gpu, tp=tp, dp=8 // tp, zero=zero, recompute=recompute, compile=compile_,
                                   fused_loss=fused_loss)
    r = estimate(m, cluster, plan, work, params)
    assert r.step_time_s > 0 and r.peak_memory_gib > 0
    assert all(t >= 0 for t in r.time.values()) and all(b >= 0 for b in r.memory.values())
    # the unfused attention (scores materialised) needs no less memory and is no faster
    unfused = estimate(m, cluster, plan.replace(flash_attention=False), work, params)
    assert unfused.peak_memory_gib >= r.peak_memory_gib * (1 - 1e-9)
    if params.attention_kernel in FLASH_KERNELS:
        assert unfused.step_time_s >= r.step_time_s * (1 - 1e-9)


ROW = {"row_id": "1", "source_id": "X", "model": "m", "num_layers": "4", "hidden_size": "4096",
       "num_attention_heads": "32", "num_kv_heads": "8", "ffn_hidden_size": "14336", "vocab_size": "128256",
       "seq_len": "4096", "gpu_type": "H100 SXM", "num_gpus": "8", "tp": "1", "pp": "1", "dp": "8",
       "micro_batch": "1", "global_batch_seqs": "16", "precision": "bf16", "reported_step_time_s": "1.0"}


@pytest.mark.parametrize("text, kernel", [
    ("torch", "eager"), ("eager", "eager"), ("math", "eager"), ("sdpa", "sdpa"), ("fused", "cudnn"),
    ("fused softmax", "fused-softmax"), ("Megatron fused softmax", "fused-softmax"),
    ("flash_attention", "flash2"), ("flash_attention2", "flash2"), ("flash_attention_2", "flash2"),
    ("flash-attn", "flash2"), ("FA1", "flash1"), ("FA2", "flash2"), ("FA3", "flash3"), ("flash v1", "flash1"),
    ("flash v2", "flash2"), ("flash v3", "flash3"), ("triton", "triton"), ("cudnn", "cudnn"),
    ("xformers", "flash2"), ("PyTorch SDPA (flash/cuDNN backend)", "sdpa"),
    ("Megatron fused softmax (2021, pre-FlashAttention)", "fused-softmax"),
    # "unfused" contains "fused attention": megatron-core's local (unfused) attention is eager
    ("unfused attention (--transformer-impl local)", "eager"), ("unfused softmax", "eager"),
    ("--attention-backend unfused (unfused)", "eager")])
def test_attention_impl_spellings(text, kernel):
    said: list[str] = []
    assert attention_kernel(text, "flash2", said.append) == kernel


def test_attention_impl_not_understood_is_said():
    said: list[str] = []
    assert attention_kernel("foo", "flash2", said.append) == "flash2"
    assert said == ["attention_impl 'foo' not understood: assumed the profile's default flash2"]


def test_run_case_profile_and_overrides():
    c = case_from_row({**ROW, "framework": "NeMo", "attention_impl": "eager"})
    assert c.ok and c.profile == "nemo" and c.overrides == {"attention_kernel": "eager"}
    assert not c.plan.flash_attention
    c = case_from_row({**ROW, "framework": "HF Trainer", "attention_impl": "sdpa"})
    assert c.profile == "hf-accelerate" and c.overrides == {}
    c = case_from_row({**ROW, "framework": "torchtitan"})
    assert c.profile == "torchtitan" and c.plan.flash_attention
    assert any("attention kernel not stated" in a for a in c.assumptions)
    c = case_from_row({**ROW, "framework": "frobnicate"})
    assert any("framework 'frobnicate' not understood" in a for a in c.assumptions)
    c = case_from_row({**ROW, "framework": "nanotron"})
    assert c.profile == "nanotron"


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("fp32", [True, False])
def test_megatron_vocab_parallel_loss_is_in_place(tp, fp32):
    """Megatron's vocabulary-parallel cross-entropy works in place on one fp32 copy of the logits:
    6 B per logit (2 on 16-bit logits), at any tp; torch's holds 14 (20 vocabulary-parallel)."""
    import numpy as np

    from meshplan.cost import batch as _b
    from meshplan.spec.transformer import as_graph
    for name in ("megatron", "nemo", "megatron-deepspeed"):
        assert get_profile(name).apply(DEFAULT_PARAMS).loss_kernel == "inplace"
    m, cluster, plan, work = _case(tp=tp, dp=8 // tp)
    cols = {k: np.asarray(v) if k != "stage_layers" else v for k, v in _b.plans_to_columns([plan]).items()}
    per_logit = {}
    for kernel in ("torch", "inplace"):
        p = DEFAULT_PARAMS.replace(loss_kernel=kernel, logits_fp32=fp32)
        a = _b.assemble(as_graph(m, work.seq_len), cluster, work, cols, p)
        b = int(a.lay.ids_where(a.lay.loss)[0])
        logits = float(a.tokens[0]) * float(a.lay.vocab[b]) / tp
        per_logit[kernel] = float(_b.logit_bytes(a, b, p)[0]) / logits
    assert per_logit["inplace"] == pytest.approx(6.0 if fp32 else 2.0)
    assert per_logit["torch"] == pytest.approx((20.0 if tp > 1 else 14.0) if fp32 else 6.0)
    # a plan that asks for the fused loss gets it under Megatron's profile too (--cross-entropy-loss-fusion)
    from meshplan.cost.compute import loss_kind
    assert loss_kind(True, get_profile("megatron").apply(DEFAULT_PARAMS)) == "fused"
    assert loss_kind(False, get_profile("megatron").apply(DEFAULT_PARAMS)) == "inplace"
