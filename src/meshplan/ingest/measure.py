"""ingest(source) -> LayerGraph: build on the meta device, trace one step, assemble the layers."""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from meshplan.errors import MeshplanError
from meshplan.ingest import layers as _layers
from meshplan.ingest import moe, tp
from meshplan.ingest import ops as _ops
from meshplan.ingest.builder import DTYPES, Built, build
from meshplan.ingest.source import parse_source
from meshplan.ingest.trace import LayerRec, Tracer, frontier, run, storage_key
from meshplan.spec.graph import LayerGraph, LayerOps, LayerSpec

LM_TASKS = tp.LM_TASKS
"""Tasks whose head is a vocabulary projection: column-split (vocabulary-parallel) under TP."""


def ingest(source: str, *, seq_len: int | None = None, dtype: str = "float32", batch_size: int = 1,
           copy_blocks: bool = True) -> LayerGraph:
    """Measure ``source`` (``hf:config.json`` or ``module:pkg.mod:factory``) layer by layer.

    Builds the model on the meta device (no memory, no weights), runs forward, loss and backward
    of a synthetic batch of ``batch_size`` samples there and returns per-sample costs per layer.
    ``copy_blocks=False`` traces every repeated block instead of copying the second one's numbers
    (slower; the numbers are the same).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise MeshplanError(f"batch_size must be a positive integer, got {batch_size!r}")
    src = parse_source(source)
    t0 = time.perf_counter()
    built = build(src, device="meta", seq_len=seq_len, dtype=dtype)
    if src.kind == "hf" and seq_len is not None and built.seq_len is None:  # an image model: planning at
        from meshplan.ingest import hf  # a sequence length it does not have would mislead
        config = hf.load_config(src)
        hf.check_image_tokens(config, hf.pick_class(config, str(src.path))[0], seq_len, src.text)
    graph = measure(built, batch_size=batch_size, started=t0, copy_blocks=copy_blocks)
    if dtype == OPS_DTYPE:
        return graph
    # LayerOps describe a bf16 step: take them from a bf16 trace, which sees what a float32 one
    # cannot (a norm's or softmax's fp32 upcasts of bf16 activations)
    try:
        built16 = build(src, device="meta", seq_len=seq_len, dtype=OPS_DTYPE)
        graph16 = measure(built16, batch_size=batch_size, copy_blocks=copy_blocks)
    except MeshplanError as e:
        return dataclasses.replace(graph, notes=(*graph.notes, f"layer ops from the {dtype} trace (a "
                                                 f"{OPS_DTYPE} trace failed: {e.message})"))
    same = [x.name for x in graph16.layers] == [x.name for x in graph.layers]
    ids = {x.block: y.block for x, y in zip(graph.layers, graph16.layers)}
    if not same or len(set(ids.values())) != len(ids):
        return dataclasses.replace(graph, notes=(*graph.notes, f"layer ops from the {dtype} trace (the "
                                                 f"{OPS_DTYPE} trace found other layers)"))
    for x, y in zip(graph.layers, graph16.layers):
        x.extra.update({k: y.extra[k] for k in _ops.EAGER_EXTRAS if k in y.extra})
    return dataclasses.replace(graph, ops={b: graph16.ops[b16] for b, b16 in ids.items()},
                               tied_split=graph16.tied_split,
                               notes=(*graph.notes, f"layer ops from a {OPS_DTYPE} trace"))


OPS_DTYPE = "bfloat16"
"""The trace dtype LayerOps come from (a float32 ingest traces a second time, for them)."""


def _leaf_sig(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"T{tuple(x.shape)}{x.dtype}"
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)
    return type(x).__name__


def measure(built: Built, *, batch_size: int = 1, started: float | None = None,
            copy_blocks: bool = True) -> LayerGraph:
    """The LayerGraph of an already built (meta) model."""
    t0 = started if started is not None else time.perf_counter()
    model = built.module
    units = _layers.find_units(model)
    sigs = {id(u): _layers.signature(u.module) for u in units}
    split = tp.model_tp(model, [(u.name, u.module) for u in units if u.in_container], built.heads, built.task,
                        built.name)  # what the runtime splits (runtime.generic reads the same)
    tp_info: dict[str, tp.TPInfo] = {}
    regions: dict[int, list[nn.Module]] = {}
    for u in units:
        if not u.in_container:
            continue
        info = tp_info.setdefault(sigs[id(u)], split.blocks[u.name])
        mods = dict(u.module.named_modules())
        regions[id(u)] = [mods[r] for r in info.regions if r in mods]

    tracer = Tracer(model, units, regions)
    tracer.copy_blocks = copy_blocks
    state = set(tracer.state_keys)

    def key(rec: LayerRec, args: tuple, kwargs: dict) -> str:
        leaves = ",".join(_leaf_sig(x) for x in tree_flatten((args, kwargs))[0])
        return f"{sigs[id(rec.unit)]}|{sum(p.numel() for p in rec.owned)}|{leaves}"

    tracer.key_fn = key
    batch = built.make_inputs(batch_size)
    with moe.uniform_routing(model) as moe_layers, built.trace_patches():
        tracer.rec = _ops.OpRecorder(DTYPES[built.dtype], param_info(units, tp_info, sigs, moe_layers), state)
        run(tracer, built.source, lambda: model(*batch.args, **batch.kwargs),
            lambda out: built.loss_fn(out, batch))
    return assemble(built, tracer, tp_info, sigs, batch_size, moe_layers, time.perf_counter() - t0, split)


def param_info(units: list[_layers.Unit], tp_info: dict[str, tp.TPInfo], sigs: dict[int, str],
               moe_layers: list[moe.MoeLayer]) -> dict[int, _ops.ParamInfo]:
    """Storage of each parameter -> its TP role, name in its layer, and expert slot."""
    experts: dict[int, str] = {}
    for m in moe_layers:
        for pname, p in m.module.named_parameters():
            slot = m.expert_params.get(pname)
            if slot is not None:
                experts[id(p)] = f"{m.name}.{slot}"
    out: dict[int, _ops.ParamInfo] = {}
    for u in units:
        t = tp_info.get(sigs[id(u)]) if u.in_container else None
        mods = dict(u.module.named_modules())
        for pname, p in u.module.named_parameters():
            k = storage_key(p)
            if k is None or k in out:
                continue
            name = pname[:-len(".weight")] if pname.endswith(".weight") else pname
            slot = experts.get(id(p))
            if slot is not None:
                parts = name.split(".")
                name = ".".join("*" if (i and parts[i - 1] == "experts" and x.isdigit()) else x
                                for i, x in enumerate(parts))
            out[k] = _ops.ParamInfo(role=t.roles.get(pname, "none") if t else "none", name=name,
                                    slot=slot or name, expert=slot is not None,
                                    attention=bool(t and pname in t.attention),
                                    fused=_ops.FUSED_PROJECTIONS.get(name.rsplit(".", 1)[-1], 1),
                                    kernel=_kernel(mods, pname, p))
    return out


def _kernel(mods: dict[str, nn.Module], pname: str, p: torch.Tensor) -> int:
    """Kernel positions of a convolution's weight (``ParamInfo.kernel``), 0 for anything else."""
    owner = mods.get(pname.rsplit(".", 1)[0] if "." in pname else "")
    if pname.rsplit(".", 1)[-1] == "weight" and type(owner) in tp.CONVS:
        return max(1, math.prod(p.shape[2:]))
    return 0


def assemble(built: Built, tracer: Tracer, tp_info: dict[str, tp.TPInfo], sigs: dict[int, str],
             batch_size: int, moe_layers: list[moe.MoeLayer], seconds: float,
             split: tp.ModelTP | None = None) -> LayerGraph:
    split = split or tp.ModelTP()
    recs = tracer.layers
    if not recs:
        raise MeshplanError(f"{built.source}: no layer ran in the forward pass",
                            hint="the model's forward must call its sub-modules")
    b = float(batch_size)
    cuts = frontier(tracer)
    notes = list(built.notes)
    # parameters: the layer whose module holds them (first call), else the layer that first used them
    params = [sum(p.numel() for p in r.owned) for r in recs]
    owned = {id(p) for r in recs for p in r.owned}
    unused = 0
    for k, plist in tracer.state_keys.items():
        for p in plist:
            if id(p) in owned:
                continue
            owned.add(id(p))
            if k in tracer.first_use:
                params[tracer.first_use[k]] += p.numel()
            else:
                unused += p.numel()
                params[0] += p.numel()
    if unused:
        notes.append(f"{unused:,} parameter elements never used in the forward pass (counted in layer 0)")
    holders: dict[int, set[int]] = {}
    seen_units: set[int] = set()
    for r in recs:
        if id(r.unit) in seen_units:
            continue
        seen_units.add(id(r.unit))
        for p in r.unit.module.parameters():
            holders.setdefault(id(p), set()).add(id(r.unit))
    tied = sum(p.numel() for p in built.module.parameters() if len(holders.get(id(p), ())) > 1)

    blocks = [i for i, r in enumerate(recs) if r.unit.in_container]
    first, last = (blocks[0], blocks[-1]) if blocks else (0, len(recs) - 1)
    ids: dict[str, str] = {}
    per_class: dict[str, int] = {}
    specs = []
    unfused = 0
    for i, r in enumerate(recs):
        src = recs[r.copy_of] if r.copy_of is not None else r
        a = src.acc
        if r.key not in ids:
            cls = type(r.unit.module).__name__
            per_class[cls] = per_class.get(cls, 0) + 1
            ids[r.key] = cls if per_class[cls] == 1 else f"{cls}.{per_class[cls]}"
        kind = ("block" if r.unit.in_container else "embedding" if i < first else "head" if i > last else "other")
        info = tp_info.get(sigs[id(r.unit)]) if r.unit.in_container else None
        flops = a.fwd + a.bwd
        style, frac, tp_max, ars = "none", 0.0, 1, 0
        extra: dict[str, float] = {"measured": 0.0 if r.copy_of is not None else 1.0,
                                   "gemm_dim": math.exp(a.gemm_logdim / a.gemm_flops) if a.gemm_flops else 1.0,
                                   "mem_bytes": a.mem / b, "send_bytes": cuts[i] / b}
        if info is not None and info.style == "megatron":
            style, tp_max, ars = info.style, info.tp_max, info.pairs
            frac = min(1.0, (a.fwd_tp + a.bwd_tp) / flops) if flops > 0 else info.param_fraction
            extra["tp_param_fraction"] = round(info.param_fraction, 6)
            extra["tp_saved_fraction"] = round(min(1.0, a.tp_saved / a.saved), 6) if a.saved else frac
        if a.attn_fwd:
            extra["attention_flops"] = a.attn_fwd / b
            extra["attention_bwd_flops"] = a.attn_bwd / b
            extra["attention_recompute_flops"] = 0.5 * a.attn_fwd / b
            extra["attention_causal"] = 1.0 if a.causal else 0.0
        if a.head_dim:
            extra["head_dim"] = float(a.head_dim)
        if a.loss_saved:
            extra["loss_saved_bytes"] = a.loss_saved / b
        if a.loss_flops:
            extra["loss_flops"] = a.loss_flops / b
        unfused += a.sdpa_unfused if r.copy_of is None else 0
        specs.append(LayerSpec(
            name=r.name or type(r.unit.module).__name__, kind=kind, block=ids[r.key], params=params[i],
            fwd_flops=a.fwd / b, bwd_flops=a.bwd / b, saved_bytes=a.saved / b,
            output_bytes=r.out_bytes / b,
            tp_style=style, tp_fraction=round(frac, 6), tp_max=tp_max, tp_allreduces=ars, extra=extra))
    copied = sum(1 for r in recs if r.copy_of is not None)
    if copied:
        notes.append(f"measured {len(recs) - copied} of {len(recs)} layers; {copied} repeated blocks copied "
                     "from the second call of their block")
    if moe_layers:
        notes.append(f"mixture of experts ({len(moe_layers)} layers) traced with uniform routing: "
                     "tokens*k/E token-expert pairs per expert")
    if any(s.extra.get("attention_flops") for s in specs):
        notes.append("attention traced as the fused flash kernel (no s x s scores kept; model FLOPs, "
                     "no causal halving)")
    if unfused:
        notes.append("attention with a learned additive bias (e.g. T5's relative positions) traced unfused "
                     "(SDPA math path: the s x s scores are saved)")
    for info in tp_info.values():
        notes.extend(n for n in info.notes if n not in notes)
    notes.extend(f"tensor parallel: {n}" if not n.startswith("tensor parallel") else n
                 for n in split.notes if n not in notes)
    why = _layers.pipeline_refusal(built.name, built.task, _layers.find_units(built.module),
                                   [r.unit for r in recs])
    if why:
        from meshplan.spec.capabilities import PIPELINE_NOTE
        notes.append(f"{PIPELINE_NOTE} {why}")
    extras: dict[str, dict[str, float]] = {}
    ops, lm_split, ops_notes = graph_ops(built, tracer, tp_info, sigs, batch_size, moe_layers, specs, params,
                                         holders, extras, split)
    notes.extend(n for n in ops_notes if n not in notes)
    for x in specs:  # per token at 2-byte activations, like LayerOps (the same for every layer of an id)
        x.extra.update(extras.get(x.block, {}))
    notes.append(f"traced at batch {batch_size}, {built.dtype}, in {seconds:.2f} s")
    return LayerGraph(name=built.name, source=built.source, task=built.task, sample_tokens=built.sample_tokens,
                      trace_dtype=built.dtype, layers=tuple(specs), tied_params=tied, notes=tuple(notes),
                      ops=ops, tied_split=lm_split or not tied)


def graph_ops(built: Built, tracer: Tracer, tp_info: dict[str, tp.TPInfo], sigs: dict[int, str], batch_size: int,
              moe_layers: list[moe.MoeLayer], specs: list[LayerSpec], params: list[int],
              holders: dict[int, set[int]], extras: dict[str, dict[str, float]],
              split: tp.ModelTP | None = None) -> tuple[dict[str, LayerOps], bool, list[str]]:
    """Block id -> LayerOps (ingest/ops.py) from each id's last measured call; whether the LM head
    is vocabulary-parallel; notes. ``extras`` receives, per block id, the eager counts LayerOps
    has no field for (ops.layer_ops)."""
    rr = tracer.rec
    recs = tracer.layers
    if rr is None:
        return {}, False, []
    tokens = float(batch_size * built.sample_tokens)
    sends = frontier(tracer, tracer.nbytes2)
    numel: dict[int, int] = {}
    biases: dict[int, int] = {}
    for m in built.module.modules():
        for _n, p in m.named_parameters(recurse=False):
            k = storage_key(p)
            if k is not None:
                numel[k] = p.numel()
        w, b = getattr(m, "weight", None), getattr(m, "bias", None)
        if isinstance(w, torch.nn.Parameter) and isinstance(b, torch.nn.Parameter) and w.dim() >= 2:
            biases[storage_key(w)] = b.numel()  # type: ignore[index]
    last = len(recs) - 1
    out_rec = rr.records.get(last, _ops.LayerRecord())
    vocab = out_rec.out_elems / tokens if out_rec.out_elems else 1.0 / tokens
    # the LM head and its vocabulary's tables are split exactly as the runtime splits them (tp.model_tp)
    split = split or tp.ModelTP()
    head = built.module.get_submodule(split.head) if split.head is not None else None
    lm_head = storage_key(head.weight) if head is not None else None
    tables = {id(built.module.get_submodule(t)) for t in split.tables}
    last_holder: dict[int, int] = {}  # a tied weight -> the last layer holding it (it counts it again)
    for i, r in enumerate(recs):
        if r.call == 0:
            for p in r.unit.module.parameters():
                if len(holders.get(id(p), ())) > 1:
                    last_holder[id(p)] = i
    rep: dict[str, int] = {}
    for i, (r, x) in enumerate(zip(recs, specs)):
        if r.copy_of is None:
            rep[x.block] = i
    ops: dict[str, LayerOps] = {}
    notes: list[str] = []
    for bid, i in rep.items():
        r, x = recs[i], specs[i]
        info = tp_info.get(sigs[id(r.unit)]) if r.unit.in_container else None
        is_tp = info is not None and info.style == "megatron"
        own = {id(p) for p in r.unit.module.parameters()}
        tied_extra = sum(p.numel() for p in r.unit.module.parameters() if last_holder.get(id(p)) == i)
        tables_here = sum(m.weight.numel() for m in r.unit.module.modules() if id(m) in tables) if r.call == 0 else 0
        moes = [m for m in moe_layers if any(id(p) in own for p in m.module.parameters())]
        norms = [r.unit.module.get_submodule(n) for n, role in (info.convs.items() if is_tp and info else ())
                 if role == "channel"]
        ctx = _ops.LayerContext(
            kind=x.kind, tp=is_tp, pairs=info.pairs if info else 0, params=float(params[i] + tied_extra),
            param_numel=numel, biases=biases, vocab_tables=float(tables_here),
            loss_vocab=vocab if i == last else 0.0, lm_head=lm_head,
            send=sends[i], heads=built.heads, experts=moes[0].experts if moes else 0,
            top_k=moes[0].top_k if moes else 0, gemm_dim=float(x.extra.get("gemm_dim", 1.0)),
            conv_pairs=info.conv_pairs if is_tp and info else 0,
            channel_params=float(sum(p.numel() for m in norms for p in m.parameters())))
        o, eager, n = _ops.layer_ops(rr.records.get(i, _ops.LayerRecord()), rr, ctx, tokens, built.sample_tokens,
                                     built.task == "causal-lm", i)
        ops[bid] = o
        extras[bid] = eager
        notes.extend(f"{bid}: {t}" for t in n)
    return ops, lm_head is not None and split.tied, notes
