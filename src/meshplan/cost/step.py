"""estimate(model, cluster, plan, workload) -> CostReport. A pure function.

Mesh axes, outermost to innermost: pp, dp, cp, tp. So a TP group is `tp` consecutive ranks
(stride 1), CP has stride tp, DP/FSDP (merged with CP for sharding) stride tp, PP stride
tp*cp*dp. A group's link tier is the slowest one its span crosses.
"""
from __future__ import annotations

from dataclasses import dataclass

from meshplan.cost.comm import Group
from meshplan.cost.compute import (ACT_BYTES, PassTimes, block_times, embedding_times,
                                   output_layer_times)
from meshplan.cost.memory import (FUSED_LOGITS_BYTES_PER_ELEM, LOGITS_BYTES_PER_ELEM, StageMemory, block_activation_bytes,
                                  model_state_bytes)
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.report import CostReport
from meshplan.cost.schedule import in_flight, pipeline_time, stage_layers
from meshplan.errors import MeshplanError
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.constraints import violations
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, Workload
from meshplan.units import GiB


@dataclass(frozen=True)
class _Ctx:
    model: ModelSpec
    cluster: ClusterSpec
    plan: Plan
    work: Workload
    p: CostParams
    microbatches: int
    tokens: float  # tokens per micro-batch per GPU (after CP split)


def _layer_params_local(model: ModelSpec, plan: Plan) -> float:
    """Parameters of one block held by one GPU before ZeRO sharding (TP and EP splits)."""
    if model.is_moe:
        experts = model.num_experts * model.mlp_params(model.expert_ffn) / plan.ep
        dense = model.layer_params() - model.num_experts * model.mlp_params(model.expert_ffn)
        return (dense + experts) / plan.tp
    return model.layer_params() / plan.tp


def _stage_params(c: _Ctx, layers: int, first: bool, last: bool) -> float:
    m, t = c.model, c.plan.tp
    n = layers * _layer_params_local(m, c.plan)
    if first:
        n += m.embedding_params() / t
    if last:
        n += (m.norm_params() + m.vocab_size * m.hidden_size) / t  # tied: a copy on the last stage
    if first and last and m.tied_embeddings:
        n -= m.vocab_size * m.hidden_size / t
    return n


def _tp_time(c: _Ctx, blk_recompute_full: bool) -> tuple[float, float]:
    """(per-block seconds of TP collectives for fwd+bwd(+recompute), per-block fwd share)."""
    if c.plan.tp == 1:
        return 0.0, 0.0
    g = Group.of(c.cluster, c.plan.tp, 1)
    one = g.all_reduce(c.tokens * c.model.hidden_size * ACT_BYTES)  # = RS + AG with SP
    n = 4 + (2 if blk_recompute_full else 0)
    return n * one, 2 * one


def _cp_time(c: _Ctx) -> float:
    if c.plan.cp == 1:
        return 0.0
    g = Group.of(c.cluster, c.plan.cp, c.plan.tp)
    kv = c.tokens * 2 * c.model.kv_dim / c.plan.tp * ACT_BYTES
    return 3 * g.all_gather(kv * c.plan.cp)  # fwd gather K,V; bwd gather K,V + scatter dK,dV


def _ep_time(c: _Ctx) -> float:
    if not c.model.is_moe or c.plan.ep == 1:
        return 0.0
    g = Group.of(c.cluster, c.plan.ep, c.plan.tp)
    size = c.tokens * c.model.experts_per_token * c.model.hidden_size * ACT_BYTES
    return 4 * g.all_to_all(size)


def _shard_group(c: _Ctx) -> Group:
    return Group.of(c.cluster, c.plan.effective_shard, c.plan.tp)


def _fsdp_per_step(plan: Plan) -> bool:
    """FSDP under a pipeline gathers once per step: torch.distributed.pipelining disables
    resharding and gradient sync for all but the last micro-batch (torchtitan's PP+FSDP)."""
    return plan.zero == 3 and plan.pp > 1


def _fsdp_block(c: _Ctx, blk: PassTimes) -> tuple[float, float]:
    """(exposed, overlapped) seconds of FSDP traffic for one block, one micro-batch."""
    if c.plan.zero != 3 or c.plan.effective_shard == 1:
        return 0.0, 0.0
    if _fsdp_per_step(c.plan):
        ag, rs = _fsdp_block_collectives(c)
        ovl = (2 * ag + rs) / max(1, c.microbatches)  # once per step, spread over micro-batches
        return 0.0, ovl
    ag, rs = _fsdp_block_collectives(c)
    exposed = max(0.0, ag - blk.fwd_s) + max(0.0, ag + rs - (blk.bwd_s + blk.recompute_s))
    return exposed, 2 * ag + rs - exposed


def _fsdp_block_collectives(c: _Ctx) -> tuple[float, float]:
    """(all-gather of bf16 params, reduce-scatter of grads) seconds for one block."""
    g = _shard_group(c)
    lp = _layer_params_local(c.model, c.plan)
    return g.all_gather(2.0 * lp), g.reduce_scatter(c.p.fsdp_reduce_bytes * lp)


def _stage_time(c: _Ctx, i: int, layers: int, blk: PassTimes, emb: PassTimes,
                out: PassTimes) -> dict[str, float]:
    """Exposed seconds of one micro-batch on stage ``i``, by term."""
    first, last = i == 0, i == c.plan.pp - 1
    rc_layers = layers
    if c.plan.recompute == "full" and c.plan.recompute_layers is not None:
        rc_layers = min(layers, c.plan.recompute_layers)
    compute = layers * (blk.fwd_s + blk.bwd_s)
    if first:
        compute += emb.fwd_s + emb.bwd_s
    if last:
        compute += out.fwd_s + out.bwd_s
    tp_full, _ = _tp_time(c, False)
    tp_rc, _ = _tp_time(c, True)
    tp = (layers - rc_layers) * tp_full + rc_layers * (tp_rc if c.plan.recompute == "full" else tp_full)
    tp_exposed = tp * (c.p.tp_exposed_async if c.plan.async_tp else 1.0)
    cp = max(0.0, _cp_time(c) - 0.5 * (blk.fwd_s + blk.bwd_s)) * layers
    fsdp_exp, fsdp_ovl = _fsdp_block(c, blk)
    pp_g = Group.of(c.cluster, 2, c.plan.tp * c.plan.cp * c.plan.dp) if c.plan.pp > 1 else None
    p2p = 0.0
    if pp_g is not None:
        act = c.tokens * c.model.hidden_size * ACT_BYTES
        if c.plan.p2p_sharded:
            act /= c.plan.tp  # Megatron scatter-gather, or sequence-parallel activations
        p2p = 2 * c.plan.virtual_stages * pp_g.send_recv(act) * c.p.pp_p2p_exposed
    return {"compute": compute, "recompute": rc_layers * blk.recompute_s,
            "tp_comm": tp_exposed, "tp_comm_overlapped": tp - tp_exposed, "cp_comm": cp,
            "ep_comm": layers * _ep_time(c), "dp_comm": layers * fsdp_exp,
            "dp_comm_overlapped": layers * fsdp_ovl, "pp_comm": p2p}


def _dp_end_of_step(c: _Ctx, params_local: float, last_bwd: float) -> tuple[float, float]:
    """(exposed, overlapped) seconds of gradient sync/parameter gather at the end of a step."""
    plan = c.plan
    n_dp = plan.dp * plan.cp
    if n_dp == 1:
        return 0.0, 0.0
    if plan.zero == 3:
        g = _shard_group(c)
        t = g.all_gather(2.0 * _layer_params_local(c.model, plan))  # first layer, once
        if plan.effective_shard < n_dp:  # HSDP: all-reduce shards across replicas
            rep = Group.of(c.cluster, n_dp // plan.effective_shard, plan.tp * plan.effective_shard)
            t += rep.all_reduce(c.p.fsdp_reduce_bytes * params_local / plan.effective_shard)
        return t, 0.0
    g = Group.of(c.cluster, n_dp, plan.tp)
    # fp32 main grads with a distributed optimizer (Megatron, DeepSpeed bf16 optimizer);
    # 16-bit gradient all-reduce for plain DDP.
    grads = (4.0 if plan.zero >= 1 else 2.0) * params_local
    allreduce = plan.grad_sync == "all-reduce" or (plan.grad_sync == "auto" and plan.zero == 0)
    sync = g.all_reduce(grads) if allreduce else g.reduce_scatter(grads)
    bucket = g.all_reduce(min(grads, c.p.dp_bucket_mib * 2**20))
    # With a pipeline the gradient sync starts after the last micro-batch's backward of the
    # stage (Megatron, DeepSpeed pipeline engine): nothing left to overlap with.
    exposed = sync if plan.pp > 1 else max(bucket, sync - last_bwd)
    if plan.zero >= 1:  # distributed optimizer: gather updated bf16 params
        exposed += g.all_gather(2.0 * params_local)
    return exposed, sync - min(sync, exposed)


def _tied_embedding_sync(c: _Ctx) -> float:
    """All-reduce of the tied embedding gradient between the first and last stage."""
    m, plan = c.model, c.plan
    if plan.pp == 1 or not m.tied_embeddings:
        return 0.0
    g = Group.of(c.cluster, 2, plan.tp * plan.cp * plan.dp)
    return g.all_reduce(2.0 * m.vocab_size * m.hidden_size / plan.tp)


def _optimizer_time(c: _Ctx, params_local: float) -> float:
    shard = c.plan.effective_shard if c.plan.zero >= 1 else 1
    n = params_local / shard
    if c.plan.offload_optimizer:
        return n / c.p.host_adam_params_per_s + n * 6.0 / (c.p.pcie_gbps * 1e9)
    gpu = c.cluster.gpu
    return n * c.p.optimizer_bytes_per_param / (gpu.hbm_bandwidth_gbps * 1e9 * c.p.hbm_efficiency)


def _stage_memory(c: _Ctx, i: int, layers: int, params_local: float) -> StageMemory:
    plan, m = c.plan, c.model
    first, last = i == 0, i == plan.pp - 1
    lp = _layer_params_local(m, plan)
    w, g, o, buffers = model_state_bytes(params_local, lp, plan, c.p)
    if _fsdp_per_step(plan):  # unsharded bf16 params + fp32 grads of the stage, whole step
        w += 2.0 * params_local
        g += 4.0 * params_local
    kept, transient = block_activation_bytes(m, plan, c.work.seq_len, layers)
    acts = kept * in_flight(plan, i, c.microbatches)
    if first:
        acts += c.tokens * m.hidden_size * ACT_BYTES * in_flight(plan, i, c.microbatches)
    if last:
        per = FUSED_LOGITS_BYTES_PER_ELEM if plan.fused_loss else LOGITS_BYTES_PER_ELEM
        transient = max(transient, c.tokens * m.vocab_size / plan.tp * per)
    transient += buffers
    frag = c.p.allocator_fragmentation * (acts + transient)
    return StageMemory(weights=w, grads=g, optimizer=o, activations=acts, transient=transient + frag,
                       overhead=c.p.framework_overhead_gib * GiB)


def check(model: ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload) -> None:
    """Raise MeshplanError naming every reason the plan cannot run (memory aside)."""
    bad = violations(model, cluster, plan, work)
    if bad:
        raise MeshplanError("plan cannot run: " + "; ".join(reason for _, reason in bad))


def estimate(model: ModelSpec, cluster: ClusterSpec, plan: Plan, work: Workload,
             params: CostParams = DEFAULT_PARAMS) -> CostReport:
    """Predict step time, throughput and peak memory per GPU of ``plan``."""
    check(model, cluster, plan, work)
    micro = work.global_batch // (plan.dp * plan.micro_batch)
    c = _Ctx(model, cluster, plan, work, params, micro, plan.micro_batch * work.seq_len / plan.cp)
    gpu, s = cluster.gpu, work.seq_len
    blk = block_times(model, plan, s, gpu, params)
    emb, out = embedding_times(model, plan, s, gpu, params), output_layer_times(model, plan, s, gpu, params)
    split = stage_layers(model, plan)
    stages = [_stage_time(c, i, n, blk, emb, out) for i, n in enumerate(split)]
    exposed_keys = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "dp_comm", "pp_comm")
    totals = [sum(st[k] for k in exposed_keys) for st in stages]
    w_frac = blk.bwd_weight_s / max(1e-30, blk.fwd_s + blk.bwd_s + blk.recompute_s)
    busy, bubble = pipeline_time(totals, micro, plan, w_frac)
    crit = max(range(len(totals)), key=totals.__getitem__)
    plocal = [_stage_params(c, n, i == 0, i == plan.pp - 1) for i, n in enumerate(split)]
    dp_exp, dp_ovl = _dp_end_of_step(c, max(plocal), stages[0]["compute"] / 2)
    dp_exp += _tied_embedding_sync(c)
    opt = max(_optimizer_time(c, pl) for pl in plocal)
    time = {k: micro * stages[crit][k] for k in stages[crit]}
    time["dp_comm"] += dp_exp
    time["dp_comm_overlapped"] += dp_ovl
    time |= {"bubble": bubble, "optimizer": opt, "overhead": params.step_overhead_s}
    step = busy + bubble + dp_exp + opt + params.step_overhead_s
    mems = [_stage_memory(c, i, n, plocal[i]) for i, n in enumerate(split)]
    worst = max(mems, key=lambda sm: sm.total)
    return _report(c, step, time, mems, worst, blk, out)


def _report(c: _Ctx, step: float, time: dict[str, float], mems: list[StageMemory],
            worst: StageMemory, blk: PassTimes, out: PassTimes) -> CostReport:
    m, plan, gpu = c.model, c.plan, c.cluster.gpu
    n = plan.num_gpus
    seqs_per_gpu_group = c.work.global_batch
    layer_flops = m.num_layers * blk.fwd_flops * plan.tp * plan.cp / plan.micro_batch
    logit_flops = out.fwd_flops * plan.tp * plan.cp / plan.micro_batch
    model_flops = 3.0 * (layer_flops + logit_flops) * seqs_per_gpu_group
    rc = m.num_layers * blk.recompute_flops * plan.tp * plan.cp / plan.micro_batch * seqs_per_gpu_group
    peak = gpu.peak("bf16" if plan.precision in ("fp8", "bf16") else plan.precision)
    usable = gpu.memory_gib * (1 - c.p.memory_margin)
    peak_gib = worst.total / GiB
    exposed = {k: v for k, v in time.items() if not k.endswith("_overlapped")}
    return CostReport(
        step_time_s=step, tokens_per_s=c.work.tokens / step,
        tflops_per_gpu=model_flops / step / n / 1e12, mfu=model_flops / step / n / peak,
        hfu=(model_flops + rc) / step / n / peak, peak_memory_gib=peak_gib,
        fits=peak_gib <= usable, usable_memory_gib=usable, params=m.num_params(), num_gpus=n,
        microbatches=c.microbatches, memory=worst.as_gib(),
        memory_per_stage=[sm.total / GiB for sm in mems], time=time,
        dominant=max(exposed, key=exposed.__getitem__))
