"""LayerOps from the trace (issue 12): what each distinct layer computes, stores and sends.

``OpRecorder`` rides along the forward pass of trace.Tracer and records, op by op and per layer,
what the cost model (cost.layer) prices; ``layer_ops`` turns one measured call of each distinct
layer into its ``spec.graph.LayerOps``: per token of the sample (``sample_tokens``), with activations
at 2 bytes (bf16), like the analytic transformer of spec/transformer.py.

GEMMs       every matrix multiply with a parameter operand (nn.Linear, HF Conv1D, fused qkv, a
            MoE's expert matrices) is Gemm(n=out, k=in, m=rows per token), split column/row as
            ingest/tp.py pairs them (the LM head: column, vocabulary-parallel), ``expert`` for the
            experts' (one Gemm per expert matrix; experts/top_k from moe.py); a convolution is its
            im2col GEMM (n = out channels, k = in channels / groups x kernel area, m = output
            positions per token); a multiply of two activations (a GNN's adjacency product, an
            einsum, a bmm) is a Gemm of its traced shapes, split when its input is.
attention   F.scaled_dot_product_attention (traced as the flash kernel) is Attention(heads, kv
            heads, head dim, causal); an eager one (a matmul of two activations, a softmax of it,
            a matmul of that) too, its s x s scores left to the cost model. An attention whose
            queries or keys are not the sample's tokens (an encoder-decoder: each stack sees half)
            stays two GEMMs of its shapes (QK^T, AV), with its heads in ``tp_divides``.
split       a tensor is TP-split when it derives from a column GEMM's output and has not passed a
            row GEMM (data flow over storages); memory-bound ops and saved tensors of a block
            with column/row GEMMs are ``*_split`` when they touch a split tensor, else ``*_rep``
            (the replicated hidden state: norms, residuals, dropout); in other layers ``*_whole``.
eager bytes  every FLOP-free, non-view op of the forward: bytes read + written (trace.py's rule),
            tensors of the trace's floating dtype counted at 2 bytes per element, others (a bf16
            trace's fp32 upcasts, masks, indices) at their own size.
fused bytes  the same ops grouped into kernels as a compiler would: connected by data flow with no
            GEMM or attention between them (same GEMM depth); a group reads its inputs and writes
            the outputs used outside it, once.
saved       eager: what autograd saves (trace.py's pack hook), as above. Fused: tensors saved inside
            a fused group are replaced by the group's inputs (a compiled kernel recomputes its
            intermediates). ``saved_rep`` (one number in LayerOps) is the fused count, as in
            spec/transformer.py. ``saved_op`` follows torchtitan's op-level SAC policy: the layer's
            input, every other matrix multiply's output and the attention's outputs.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from meshplan.ingest import flops as _flops
from meshplan.ingest import moe as _moe
from meshplan.spec.graph import Attention, Gemm, LayerOps

aten = torch.ops.aten
ACT = 2.0
"""Bytes per activation element in LayerOps."""
GEMM_OPS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution, aten._convolution}
SOFTMAX_OPS = {aten._softmax, getattr(aten, "_safe_softmax", aten._softmax)}
SAC_MM = {aten.mm, aten.addmm}
RANDOM_OPS = {aten.bernoulli, aten.bernoulli_, aten.rand, aten.rand_like, aten.randn, aten.randn_like,
              aten.native_dropout, aten.uniform_, aten.normal_}
"""Ops whose outputs a compiled kernel keeps rather than recomputes (dropout masks)."""
"""Matrix multiplies op-level SAC counts (torchtitan: every other one's output is kept)."""
FUSED_PROJECTIONS = {"gate_up_proj": 2}
EAGER_EXTRAS = ("saved_rep_eager", "saved_whole_eager")
"""LayerSpec.extra keys: the eager counts of LayerOps' single-valued saved_rep / saved_whole
(which hold the fused counts, as spec/transformer.py does), bytes per token at 2-byte activations."""
"""Column matrices holding several projections side by side, by how many (the width TP must
divide is one projection's)."""


@dataclass(frozen=True)
class ParamInfo:
    """What ingestion knows of a parameter (by storage) before the trace."""

    role: str = "none"
    """column | row | none (ingest/tp.py's pairs)."""
    name: str = ""
    """Its path inside its layer (for tp_divides), experts' index replaced by ``*``."""
    slot: str = ""
    """GEMMs of the same slot are one Gemm (an expert matrix: every expert's)."""
    expert: bool = False
    attention: bool = False
    fused: int = 1
    kernel: int = 0
    """A convolution's weight: its kernel positions (a row convolution's GEMM k is in channels x
    kernel); 0 for a matrix."""


@dataclass
class _Gemm:
    opid: int
    param: int | None
    n: float
    k: float
    rows: float
    split_in: bool
    act: int | None = None
    """Storage of the activation operand (GEMMs of one input are one Gemm of their summed widths)."""


@dataclass
class _Attn:
    heads: int
    kv_heads: int
    head_dim: int
    v_dim: int
    s_q: int
    s_k: int
    batch: int
    causal: bool
    masked: bool
    split: bool
    eager: int | None = None
    """The candidate id of an eager attention (its scores' tag), None for SDPA."""


@dataclass
class _Ew:
    opid: int
    ins: list[tuple[int, float, int | None, bool]]
    """(storage, bytes read, producing memory-bound op, split)."""
    outs: list[tuple[int, float, bool]]
    split: bool
    score: int | None
    level: int
    gather: bool
    random: bool = False


@dataclass
class _Saved:
    key: int
    nbytes: float
    split: bool
    score: int | None
    routed: bool = False
    """Saved while a MoE layer's token-expert pairs ran (ingest.moe.routed)."""


@dataclass
class _Candidate:
    """A multiply of two activations that may be an eager attention's QK^T."""

    qk: _Gemm
    layer: int
    shape: tuple[int, int, int, int]  # batch, s_q, head_dim, s_k
    split: bool
    softmax: bool = False
    av: _Gemm | None = None
    v_dim: int = 0


@dataclass
class LayerRecord:
    """What the forward of one layer call did (per trace batch, bytes at 2-byte activations)."""

    gemms: list[_Gemm] = field(default_factory=list)
    attns: list[_Attn] = field(default_factory=list)
    ews: list[_Ew] = field(default_factory=list)
    saved: list[_Saved] = field(default_factory=list)
    sac: list[tuple[int, float, bool]] = field(default_factory=list)
    """(storage, bytes, split) that op-level SAC keeps: odd mm outputs and attention outputs."""
    mm_count: int = 0
    other_flops: float = 0.0
    """FLOPs of ops that are neither GEMMs nor attention (a fallback GEMM reproduces them)."""
    conv_rows: float = 0.0
    """Bytes of the row convolutions' outputs (what their pairs all-reduce)."""
    inp: float = 0.0
    inp_key: int | None = None
    out: float = 0.0
    out_elems: float = 0.0


def storage_key(t: torch.Tensor) -> int | None:
    """The identity of a tensor's storage (views share it); None where it has none."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's whole storage (a view holds all of it alive)."""
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, AttributeError):
        return t.numel() * t.element_size()


class OpRecorder:
    """Per-op records of the forward pass (see the module docstring); driven by trace.Tracer."""

    def __init__(self, trace_dtype: torch.dtype, params: dict[int, ParamInfo], state: set[int]) -> None:
        self.dtype = trace_dtype
        self.params = params
        self.state = state
        self.split: set[int] = set()
        self.score: dict[int, int] = {}
        self.level: dict[int, int] = {}
        self.producer: dict[int, int] = {}
        self.consumers: dict[int, set[int]] = {}
        self.candidates: list[_Candidate] = []
        self.records: dict[int, LayerRecord] = {}
        self.made: dict[int, int] = {}
        """Storage -> the layer whose op made it."""
        self.layer_now = 0
        self.next_op = 0

    # -- helpers --------------------------------------------------------------------------------
    def scale(self, t: torch.Tensor) -> float:
        """Bytes per traced byte at 2-byte activations."""
        return ACT / t.element_size() if t.dtype == self.dtype and t.is_floating_point() else 1.0

    def nbytes(self, t: torch.Tensor) -> float:
        return t.numel() * t.element_size() * self.scale(t)

    def record(self, layer: int) -> LayerRecord:
        r = self.records.get(layer)
        if r is None:
            r = self.records[layer] = LayerRecord()
        return r

    # -- layer boundaries --------------------------------------------------------------------------
    def layer_input(self, layer: int, args: Any, kwargs: Any) -> None:
        first = next((t for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
        if first is not None:
            r = self.record(layer)
            r.inp, r.inp_key = self.nbytes(first), storage_key(first)

    def layer_output(self, layer: int, out: Any) -> None:
        first = next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()),
                     None)
        if first is not None:
            r = self.record(layer)
            r.out, r.out_elems = self.nbytes(first), float(first.numel())

    def saved(self, layer: int, t: torch.Tensor, key: int) -> None:
        self.record(layer).saved.append(_Saved(key, storage_bytes(t) * self.scale(t), key in self.split,
                                               self.score.get(key), _moe.in_routed()))

    # -- ops --------------------------------------------------------------------------------------
    def op(self, func: Any, packet: Any, args: tuple, kwargs: dict, out: Any, flops: float, layer: int) -> None:
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        in_keys = [storage_key(t) for t in ins]
        out_keys = [storage_key(t) for t in outs]
        mutable = func._schema.is_mutable
        if func.is_view or (not mutable and set(out_keys) & set(in_keys)):
            return  # an alias: tags follow the storage
        opid = self.next_op
        self.next_op += 1
        for k in set(in_keys):
            if k in self.producer:
                self.consumers.setdefault(k, set()).add(opid)
        split_in = any(k in self.split for k in in_keys)
        score_in = next((self.score[k] for k in in_keys if k in self.score), None)
        level = max((self.level.get(k, 0) for k in in_keys), default=0)
        rec = self.record(layer)
        self.layer_now = layer
        if packet in GEMM_OPS and flops:
            self._gemm(rec, layer, packet, args, outs, out_keys, flops, split_in, score_in, opid, level)
        elif packet in _flops.ATTENTION_FWD:
            self._attention(rec, func, args, kwargs, outs, out_keys, split_in, level)
        elif flops:
            rec.other_flops += flops
            self._tag(out_keys, split_in, None, level + 1)
        else:
            self._ew(rec, packet, ins, in_keys, outs, out_keys, split_in, score_in, opid, level)

    def _tag(self, keys: list[int | None], split: bool, score: int | None, level: int) -> None:
        for k in keys:
            if k is None:
                continue
            self.made.setdefault(k, self.layer_now)
            if split:
                self.split.add(k)
            else:
                self.split.discard(k)
            if score is not None:
                self.score[k] = score
            else:
                self.score.pop(k, None)
            self.level[k] = level

    def _gemm(self, rec: LayerRecord, layer: int, packet: Any, args: tuple, outs: list, out_keys: list,
              flops: float, split_in: bool, score_in: int | None, opid: int, level: int) -> None:
        if packet in (aten.convolution, aten._convolution):
            x, w = args[0], args[1]
            transposed = bool(args[6]) if len(args) > 6 else False
            if transposed:
                n, k = w.shape[1], w.shape[0] * math.prod(w.shape[2:])
            else:
                n, k = w.shape[0], math.prod(w.shape[1:])
            a, b, param = x, w, storage_key(w) if storage_key(w) in self.state else None
            act = storage_key(x)
            rows = flops / (2.0 * n * k) if n * k else 0.0
        else:
            a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm) else (args[0], args[1])
            batch = a.shape[0] if a.dim() == 3 else 1
            m_, k_, n_ = a.shape[-2], a.shape[-1], b.shape[-1]
            ka, kb = storage_key(a), storage_key(b)
            if kb in self.state:
                param, n, k, rows, act = kb, n_, k_, batch * m_, ka
            elif ka in self.state:
                param, n, k, rows, act = ka, m_, k_, batch * n_, kb
            else:
                param, n, k, rows, act = None, n_, k_, batch * m_, None
            if n * k and abs(2.0 * rows * n * k - flops) > 1e-6 * flops:
                rows = flops / (2.0 * n * k)
        g = _Gemm(opid, param, float(n), float(k), float(rows), split_in, act)
        rec.gemms.append(g)
        if param is not None:
            role = self.params.get(param, ParamInfo()).role
            split = role == "column" or (role == "none" and split_in)
            if role == "row" and self.params[param].kernel:
                rec.conv_rows += self.nbytes(outs[0])
            self._tag(out_keys, split, None, level + 1)
        else:
            split = split_in
            cand = self.candidates[score_in] if score_in is not None else None
            if cand is not None and cand.softmax and cand.av is None and cand.layer == layer:
                cand.av, cand.v_dim = g, int(outs[0].shape[-1])
                self._tag(out_keys, split, None, level + 1)
            else:
                shape = (a.shape[0] if a.dim() == 3 else 1, a.shape[-2], a.shape[-1], b.shape[-1])
                self.candidates.append(_Candidate(g, layer, shape, split))
                self._tag(out_keys, split, len(self.candidates) - 1, level + 1)
        if packet in SAC_MM:
            rec.mm_count += 1
            if rec.mm_count % 2 == 1:
                rec.sac.append((out_keys[0], self.nbytes(outs[0]), split))

    def _attention(self, rec: LayerRecord, func: Any, args: tuple, kwargs: dict, outs: list, out_keys: list,
                   split_in: bool, level: int) -> None:
        named = dict(kwargs)
        for a, v in zip(func._schema.arguments, args):
            named.setdefault(a.name, v)
        q, k, v = args[0], args[1], args[2]
        if q.dim() == 4 and k.dim() == 4 and v.dim() == 4:
            rec.attns.append(_Attn(
                heads=int(q.shape[1]), kv_heads=int(k.shape[1]), head_dim=int(q.shape[-1]), v_dim=int(v.shape[-1]),
                s_q=int(q.shape[2]), s_k=int(k.shape[2]), batch=int(q.shape[0]),
                causal=bool(named.get("is_causal", False)),
                masked=isinstance(named.get("attn_mask", named.get("attn_bias")), torch.Tensor), split=split_in))
        self._tag(out_keys, split_in, None, level + 1)
        for t, key in zip(outs, out_keys):
            rec.sac.append((key, self.nbytes(t), split_in))

    def _ew(self, rec: LayerRecord, packet: Any, ins: list, in_keys: list, outs: list, out_keys: list,
            split_in: bool, score_in: int | None, opid: int, level: int) -> None:
        written = [(k, self.nbytes(t), split_in) for t, k in zip(outs, out_keys)]
        total_w = sum(b for _, b, _ in written)
        reads = []
        for t, k in zip(ins, in_keys):
            b = min(t.numel() * t.element_size(), storage_bytes(t)) * self.scale(t)
            if k in self.state:
                b = min(b, total_w)
            reads.append((k, b, self.producer.get(k), k in self.split))
        rec.ews.append(_Ew(opid, reads, written, split_in, score_in, level, packet is aten.embedding,
                           packet in RANDOM_OPS))
        if packet in SOFTMAX_OPS and score_in is not None:
            self.candidates[score_in].softmax = True
        self._tag(out_keys, split_in, score_in, level)
        for k in out_keys:
            if k is not None:
                self.producer[k] = opid


# ---- LayerOps of a measured layer ----------------------------------------------------------------

@dataclass
class LayerContext:
    """What layer_ops needs to know of a layer besides its record."""

    kind: str
    tp: bool
    """The layer is a block with column/row pairs (TP splits it)."""
    pairs: int
    params: float
    """Parameter elements it holds (LayerSpec.params + a tied weight again at the last layer holding it)."""
    param_numel: dict[int, int]
    """Storage -> elements of the parameters the layer's GEMMs use (params_split)."""
    biases: dict[int, int]
    """Storage of a weight -> elements of its module's bias (split with a column weight)."""
    vocab_tables: float
    """Elements of vocabulary-parallel embedding tables in the layer."""
    loss_vocab: float
    lm_head: int | None
    """Storage of the LM head's weight (column-split, vocabulary-parallel: ingest.tp.model_tp), None when
    TP keeps it whole; the loss is vocabulary-parallel in the layer whose GEMMs use it."""
    send: float
    heads: tuple[int | None, int | None]
    experts: int = 0
    top_k: int = 0
    gemm_dim: float = 1024.0
    conv_pairs: int = 0
    """Of ``pairs``: convolution pairs (each all-reduces its row convolution's output, not the layer's)."""
    channel_params: float = 0.0
    """Elements of the BatchNorm parameters split with a column convolution's channels."""


def layer_ops(rec: LayerRecord, rr: OpRecorder, ctx: LayerContext, tokens: float, sample_tokens: int,
              causal_lm: bool, layer: int) -> tuple[LayerOps, dict[str, float], list[str]]:
    """The LayerOps of one measured layer call (``layer``: its index); ``tokens`` = trace batch x
    sample_tokens. Also the eager counts of the single-valued saved bytes (LayerOps keeps the fused
    ones: ``saved_rep_eager``, ``saved_whole_eager``) and notes on what could not be represented
    exactly."""
    notes: list[str] = []
    per = 1.0 / tokens
    # -- attention: SDPA calls and eager candidates of this layer --------------------------------
    found: list[_Attn] = list(rec.attns)
    absorbed: set[int] = set()
    for cid, c in enumerate(rr.candidates):
        if c.av is None or not c.softmax or not any(g is c.qk for g in rec.gemms):
            continue
        batch, s_q, d, s_k = c.shape
        b = max(1, round(tokens / sample_tokens))
        heads = max(1, batch // b)
        kv = ctx.heads[1] if ctx.heads[0] == heads and ctx.heads[1] else heads
        found.append(_Attn(heads=heads, kv_heads=kv, head_dim=d, v_dim=c.v_dim, s_q=s_q, s_k=s_k, batch=b,
                           causal=causal_lm, masked=True, split=c.split, eager=cid))
    attention: Attention | None = None
    gemms: list[Gemm] = []
    divides: dict[str, int] = {}
    eager_gemms: set[int] = set()
    for a in found:
        if a.kv_heads == a.heads and ctx.heads[0] == a.heads and ctx.heads[1]:
            a.kv_heads = ctx.heads[1]  # k/v repeated to every query head before the kernel (repeat_kv)
        whole = a.s_q == sample_tokens and a.s_k == sample_tokens and a.v_dim == a.head_dim
        causal = a.causal or (causal_lm and a.masked)
        if whole and (attention is None or (attention.head_dim == a.head_dim and attention.causal == causal)):
            attention = Attention(heads=a.heads + (attention.heads if attention else 0),
                                  kv_heads=a.kv_heads + (attention.kv_heads if attention else 0),
                                  head_dim=a.head_dim, causal=causal)
            if a.eager is not None:
                absorbed.add(a.eager)
                c = rr.candidates[a.eager]
                eager_gemms |= {c.qk.opid, c.av.opid}  # type: ignore[union-attr]
            continue
        # queries or keys other than the sample's tokens: QK^T and AV as GEMMs of their shapes
        split = "column" if a.split and ctx.tp else "none"
        m = a.batch * a.heads * a.s_q / tokens
        if a.eager is not None:
            c = rr.candidates[a.eager]
            eager_gemms |= {c.qk.opid, c.av.opid}  # type: ignore[union-attr]
        gemms += [Gemm(n=float(a.s_k), k=float(a.head_dim), m=m, split=split),
                  Gemm(n=float(a.v_dim), k=float(a.s_k), m=m, split=split)]
        if split != "none":
            divides["attention heads"] = a.heads
    if attention is not None and len(found) > 1:
        notes.append("several attentions in one layer: one Attention of their heads")

    # -- GEMMs with parameters, grouped by weight (experts: by slot) ----------------------------
    groups: dict[Any, list[_Gemm]] = {}
    for g in rec.gemms:
        if g.opid in eager_gemms:
            continue
        info = rr.params.get(g.param, ParamInfo()) if g.param is not None else None
        key = (("slot", info.slot) if info is not None and info.expert else ("param", g.param)) \
            if g.param is not None else ("act", g.opid)
        groups.setdefault(key, []).append(g)
    params_split = 0.0
    params_expert = 0.0
    params_ep = 0.0
    split_weights: set[int] = set()
    merged: dict[tuple, int] = {}  # (input, split, k, rows) -> index in gemms: one input, one GEMM
    for key, gs in groups.items():
        g = gs[0]
        if key[0] == "act":
            gemms.append(Gemm(n=g.n, k=g.k, m=g.rows / tokens, split="column" if g.split_in and ctx.tp else "none"))
            continue
        info = rr.params.get(g.param, ParamInfo())
        role = info.role if ctx.tp else "none"
        if g.param == ctx.lm_head:
            role = "column"
        rows = sum(x.rows for x in gs)
        same = (g.act, role, g.k, rows, info.expert) if len(gs) == 1 and g.act is not None else None
        if same is not None and same in merged:
            j = merged[same]
            gemms[j] = dataclasses.replace(gemms[j], n=gemms[j].n + g.n)
        else:
            if same is not None:
                merged[same] = len(gemms)
            gemms.append(Gemm(n=g.n, k=g.k, split=role, expert=True) if info.expert
                         else Gemm(n=g.n, k=g.k, m=rows / tokens, split=role))
        if role != "none":
            split_weights.add(g.param)  # type: ignore[arg-type]
            if g.param != ctx.lm_head and not (info.attention and found):
                width = g.n / info.fused if role == "column" else g.k / max(1, info.kernel)
                unit = "channels" if info.kernel else "features"
                name = f"{info.name}.{'out' if role == 'column' else 'in'}_{unit}"
                divides[name] = int(width)
    for key_, gs in groups.items():  # parameters of experts: every expert's
        if key_[0] == "slot":
            info = rr.params.get(gs[0].param, ParamInfo())
            numel = sum(n for k, n in ctx.param_numel.items() if rr.params.get(k, ParamInfo()).slot == info.slot)
            if gs[0].param in split_weights:  # TP splits them and EP divides them
                params_expert += numel
                params_split += numel
            else:  # kept whole under TP (fused 3-D parameters): EP alone divides them
                params_ep += numel
    for p in split_weights:
        if rr.params.get(p, ParamInfo()).expert:
            continue
        params_split += ctx.param_numel.get(p, 0)
        if rr.params.get(p, ParamInfo()).role == "column" or p == ctx.lm_head:
            params_split += ctx.biases.get(p, 0)
    params_split += ctx.vocab_tables
    if ctx.tp:
        params_split += ctx.channel_params
    if rec.other_flops:
        d = ctx.gemm_dim if ctx.gemm_dim > 1 else 1024.0
        gemms.append(Gemm(n=d, k=d, m=rec.other_flops / (2.0 * d * d) * per))
        notes.append("FLOPs of ops that are neither matrix multiplies nor attention as one GEMM")

    # -- memory-bound bytes: eager per op, fused per group ----------------------------------------
    ews = [e for e in rec.ews if e.score not in absorbed]
    region = _regions(ews)
    eager = {"split": 0.0, "rep": 0.0}
    gather = 0.0
    for e in ews:
        b = sum(x[1] for x in e.ins) + sum(x[1] for x in e.outs)
        eager["split" if e.split else "rep"] += b
        if e.gather:
            gather += b
    fused = {"split": 0.0, "rep": 0.0}
    members: dict[int, set[int]] = {}
    for e in ews:
        members.setdefault(region[e.opid], set()).add(e.opid)
    by_region: dict[int, list[_Ew]] = {}
    for e in ews:
        by_region.setdefault(region[e.opid], []).append(e)
    ext_inputs: dict[int, list[tuple[int, float, bool]]] = {}
    for r, es in by_region.items():
        mem = members[r]
        split = any(e.split for e in es)
        seen: set[int | None] = set()
        total = 0.0
        ext = []
        for e in es:
            for key, b, prod, sp in e.ins:
                if prod in mem or key in seen:
                    continue
                seen.add(key)
                total += b
                if key not in rr.state and (key == rec.inp_key or rr.made.get(key) == layer):
                    ext.append((key, b, sp))  # what the group recomputes from (not a side input)
            for key, b, _sp in e.outs:
                if key in seen:
                    continue
                seen.add(key)
                users = rr.consumers.get(key, set())
                if not users or users - mem:
                    total += b
        fused["split" if split else "rep"] += total
        ext_inputs[r] = ext

    # -- saved tensors ------------------------------------------------------------------------------
    internal: dict[int, int] = {}  # storage made and used only inside one fused group -> the group
    random: set[int | None] = set()
    for e in ews:
        for key, _b, _sp in e.outs:
            users = rr.consumers.get(key, set())
            if e.random:
                random.add(key)
            if users and not users - members[region[e.opid]] and key not in random:
                internal[key] = region[e.opid]
            else:
                internal.pop(key, None)
    saved = [s for s in rec.saved if s.score not in absorbed]
    s_eager = {"split": 0.0, "rep": 0.0}
    s_fused = {"split": 0.0, "rep": 0.0}
    r_eager = {"split": 0.0, "rep": 0.0}  # of which routed (a MoE's token-expert pairs: ingest.moe.routed)
    r_fused = {"split": 0.0, "rep": 0.0}
    counted: set[int | None] = set()
    for s in saved:
        s_eager["split" if s.split else "rep"] += s.nbytes
        if s.routed:
            r_eager["split" if s.split else "rep"] += s.nbytes
        if s.key in internal:
            for key, b, sp in ext_inputs.get(internal[s.key], []):
                if key not in counted:
                    counted.add(key)
                    s_fused["split" if sp else "rep"] += b
                    if s.routed:
                        r_fused["split" if sp else "rep"] += b
        elif s.key not in counted:
            counted.add(s.key)
            s_fused["split" if s.split else "rep"] += s.nbytes
            if s.routed:
                r_fused["split" if s.split else "rep"] += s.nbytes
    op_rep, op_split = rec.inp, 0.0
    sac_seen: set[int | None] = set()
    for key, b, sp in rec.sac:
        if key in sac_seen:
            continue
        sac_seen.add(key)
        if sp and ctx.tp:
            op_split += b
        else:
            op_rep += b

    tp = ctx.tp
    ew_total = eager["split"] + eager["rep"]
    g_frac = gather / ew_total if ew_total else 0.0
    no_flops = not gemms and attention is None
    ops = LayerOps(
        params=float(ctx.params), params_split=min(float(ctx.params), params_split),
        params_expert=min(params_expert, params_split),
        params_ep=min(params_ep, max(0.0, float(ctx.params) - min(float(ctx.params), params_split))), gemms=tuple(gemms), attention=attention,
        experts=ctx.experts if ctx.top_k else 0, top_k=ctx.top_k if ctx.experts else 0,
        ew_rep=(fused["rep"] * per, eager["rep"] * per) if tp else (0.0, 0.0),
        ew_split=(fused["split"] * per, eager["split"] * per) if tp else (0.0, 0.0),
        ew_whole=0.0 if tp else ew_total * per,
        ew_bwd_input=0.0 if no_flops and g_frac > 0 else 2.0 * (1.0 - g_frac), ew_bwd_weight=2.0 * g_frac,
        saved_rep=s_fused["rep"] * per if tp else 0.0,
        saved_split=(s_fused["split"] * per, s_eager["split"] * per) if tp else (0.0, 0.0),
        saved_whole=0.0 if tp else (s_fused["rep"] + s_fused["split"]) * per,
        saved_routed_rep=(r_fused["rep"] if tp else r_fused["rep"] + r_fused["split"]) * per,
        saved_routed_split=(r_fused["split"] * per, r_eager["split"] * per) if tp else (0.0, 0.0),
        saved_input=rec.inp * per,
        saved_op=(op_rep * per, op_split * per),
        hidden=rec.out * per, send=ctx.send * per, tp_allreduces=ctx.pairs if tp else 0,
        tp_reduce=(rec.conv_rows + (ctx.pairs - ctx.conv_pairs) * rec.out) * per if tp and ctx.conv_pairs else 0.0,
        loss_vocab=ctx.loss_vocab,
        loss_split=not ctx.loss_vocab or (ctx.lm_head is not None and any(g.param == ctx.lm_head for g in rec.gemms)),
        fp8=ctx.kind != "head", tp_divides=divides)
    eager_rep = dict(zip(EAGER_EXTRAS, (s_eager["rep"] * per if tp else 0.0,
                                        0.0 if tp else (s_eager["rep"] + s_eager["split"]) * per)))
    return ops, eager_rep, notes


def _regions(ews: list[_Ew]) -> dict[int, int]:
    """op id -> its fused group: memory-bound ops joined through the tensors one makes and the
    other reads, at the same GEMM depth (a compiler cannot fuse across a GEMM)."""
    parent = {e.opid: e.opid for e in ews}
    level = {e.opid: e.level for e in ews}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for e in ews:
        for _key, _b, prod, _sp in e.ins:
            if prod is not None and prod in parent and level[prod] == e.level:
                a, b = find(prod), find(e.opid)
                if a != b:
                    parent[b] = a
    return {x: find(x) for x in parent}

