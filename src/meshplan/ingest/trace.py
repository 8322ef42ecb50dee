"""Measure a module layer by layer on the meta device: FLOPs, saved activations, sends, parameters.

One forward + loss + backward of a synthetic batch runs on the meta device (shapes, no values, no
memory) under three instruments:

- a TorchDispatchMode counting FLOPs with torch.utils.flop_counter's formulas (plus flops.py) and
  recording, for every storage, the layer that produced it and the last layer that read it;
- ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd keeps for backward, counted
  once per storage (parameters and buffers excluded) at the layer running when it is first saved;
- forward pre-hooks on the layers (layers.py) setting the *current* layer. Work outside any layer
  (rotary tables, masks, the loss) goes to the layer that ran last (before the first: the first).

Backward ops are attributed to the layer whose forward created the autograd node running them
(autograd sequence numbers, recorded at each layer's start). Attention runs as the fused flash
kernel (``F.scaled_dot_product_attention`` is redirected to the CPU flash op on meta), so what is
saved is what a FlashAttention training run keeps (q, k, v, out, log-sum-exp; no s x s matrix).

Repeated blocks: the first two calls of each distinct block (same class, parameter shapes, scalar
settings, owned parameters and input shapes) are measured; later calls are skipped (their forward
returns its input, re-wired like the measured block's output) and get the second call's numbers,
which already reflect storages shared with earlier layers (the rotary tables, T5's encoder output).
"""
from __future__ import annotations

import bisect
import math
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from meshplan.errors import MeshplanError
from meshplan.ingest import flops as _flops
from meshplan.ingest.layers import Unit
from meshplan.ingest.ops import OpRecorder, storage_bytes, storage_key

_ACCUMULATE = 2**63  # AccumulateGrad nodes have sequence number UINT64_MAX
_META_QUERIES = {
    torch.ops.aten.sym_size.default, torch.ops.aten.sym_stride.default, torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default, torch.ops.aten.is_contiguous.default,
    torch.ops.aten.size.default, torch.ops.aten.stride.default, torch.ops.aten.numel.default,
    torch.ops.aten.dim.default, torch.ops.prim.layout.default,
}
_VALUE_READS = {
    torch.Tensor.item: "Tensor.item()", torch.Tensor.tolist: "Tensor.tolist()", torch.Tensor.numpy: "Tensor.numpy()",
    torch.Tensor.__bool__: "bool(tensor) (an `if`/`while` on a tensor value)", torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)", torch.Tensor.__index__: "a tensor used as an index",
    torch.Tensor.__complex__: "complex(tensor)", torch.Tensor.cpu: "Tensor.cpu()",
}
_TRACE_HINT = ("ingest runs the model on the meta device, where tensors have shapes but no values: replace "
               "value-dependent code (.item(), .tolist(), .numpy(), `if tensor:`, boolean-mask indexing, nonzero) "
               "by shape arithmetic, or take another path when x.is_meta")


class ValueRead(Exception):
    """Raised inside the trace when the model reads a tensor's value."""


ASSUME_TRUE: set[str] = set()
"""Source files whose ``bool(tensor)`` checks on meta tensors are answered True instead of failing
(transformers' mask helpers asking "is every token unmasked / unpacked?": a synthetic batch is)."""


def _asked_from(files: set[str]) -> bool:
    f = sys._getframe(2)
    for _ in range(4):
        if f is None:
            return False
        if f.f_code.co_filename in files:
            return True
        f = f.f_back
    return False


@dataclass
class Acc:
    fwd: float = 0.0
    bwd: float = 0.0
    fwd_tp: float = 0.0
    bwd_tp: float = 0.0
    attn_fwd: float = 0.0
    attn_bwd: float = 0.0
    saved: float = 0.0
    loss_saved: float = 0.0
    tp_saved: float = 0.0
    mem: float = 0.0
    """Forward bytes read + written by FLOP-free, non-view ops (memory-bound work)."""
    gemm_flops: float = 0.0
    gemm_logdim: float = 0.0
    """Sum over matrix multiplies of FLOPs x log(sqrt(in x out)) of the weight-side operand."""
    causal: bool = False
    head_dim: int = 0
    sdpa_unfused: int = 0
    out_bytes: float = 0.0
    """Bytes of the layer's primary output (its first floating tensor)."""
    loss_flops: float = 0.0
    """Of ``fwd``: the loss's FLOPs (a loss computed with matrix multiplies)."""


@dataclass(eq=False)
class LayerRec:
    index: int
    unit: Unit
    name: str
    call: int
    owned: list[nn.Parameter]
    key: str = ""
    acc: Acc = field(default_factory=Acc)
    copy_of: int | None = None
    out_bytes: float = 0.0
    io: Any = None  # (input treespec, input leaves, output treespec, output plan, consumed input flags)


_GEMMS = {torch.ops.aten.mm: 1, torch.ops.aten.addmm: 2, torch.ops.aten.bmm: 1, torch.ops.aten.baddbmm: 2,
          torch.ops.aten.convolution: 1}
"""Matrix-multiply ops -> index of the weight-side operand (for gemm_dim)."""


def _sdpa_meta(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention as the fused CPU flash kernel (meta tensors)."""
    if (query.is_meta and query.dim() == 4 and key.dim() == 4 and value.dim() == 4
            and not (attn_mask is not None and attn_mask.requires_grad)  # a learned bias (T5): math path
            and query.shape[-1] == value.shape[-1] and query.shape[1] % key.shape[1] == 0):
        if attn_mask is not None and attn_mask.dtype == torch.bool and is_causal:
            attn_mask = None
        out, _lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        return out
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


class _FunctionGuard(TorchFunctionMode):
    """Redirects SDPA to the flash kernel and turns value reads on meta tensors into ValueRead."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.tracer.note_sdpa(*args, **kwargs)
            return _sdpa_meta(*args, **kwargs)
        what = _VALUE_READS.get(func)
        if what is not None and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            if func is torch.Tensor.__bool__ and ASSUME_TRUE and _asked_from(ASSUME_TRUE):
                return True
            raise ValueRead(what)
        return func(*args, **kwargs)


class Tracer(TorchDispatchMode):
    """The dispatch-level instrument (see the module docstring); also owns the hooks' state."""

    def __init__(self, model: nn.Module, units: list[Unit], tp_regions: dict[int, list[nn.Module]]) -> None:
        super().__init__()
        self.model = model
        self.units = units
        self.registry = _flops.registry()
        self.phase = "idle"
        self.internal = False
        self.layers: list[LayerRec] = []
        self.bounds: list[int] = []
        self.stack: list[int] = []
        self.current = 0
        self.calls: dict[int, int] = {}
        self.owned: set[int] = set()
        self.measured: dict[str, list[int]] = {}
        self.tp_regions = tp_regions
        self.tp_depth = 0
        self.tp_starts: list[int] = []
        self.tp_ends: list[int] = []
        self.state_keys: dict[int, list[nn.Parameter]] = {}
        for p in model.parameters():
            k = storage_key(p)
            if k is not None:
                self.state_keys.setdefault(k, []).append(p)
        self.buffer_keys = {storage_key(b) for b in model.buffers()}
        self.first_use: dict[int, int] = {}
        self.saved_seen: set[int] = set()
        self.producer: dict[int, int] = {}
        self.consumer: dict[int, int] = {}
        self.nbytes: dict[int, int] = {}
        self.keep: list[Any] = []
        self.last_op = ""
        self.pre = Acc()
        self.copy_blocks = True
        self.tp_inputs: set[int] = set()
        self.key_fn: Callable[[LayerRec, tuple, dict], str] = lambda rec, a, k: ""
        self.rec: OpRecorder | None = None
        """Per-op records of the forward for LayerOps (ingest/ops.py), when set."""
        self.nbytes2: dict[int, float] = {}
        """Storage bytes at 2-byte activations (the recorder's scale), for the sends of LayerOps."""
        with torch.enable_grad():
            self._probe = torch.zeros(1, device="meta", requires_grad=True)

    # -- sequence numbers ------------------------------------------------------------------------
    def seq(self) -> int:
        self.internal = True
        try:
            with torch.enable_grad():
                return self._probe.view(-1).grad_fn._sequence_nr()
        finally:
            self.internal = False

    def _bwd_layer(self) -> tuple[int, bool]:
        node = torch._C._current_autograd_node()
        if node is None:
            return len(self.layers) - 1, False
        s = node._sequence_nr()
        if s >= _ACCUMULATE:
            return len(self.layers) - 1, False
        i = max(0, bisect.bisect_right(self.bounds, s) - 1)
        j = bisect.bisect_right(self.tp_starts, s) - 1
        return i, j >= 0 and s <= self.tp_ends[j]

    # -- dispatch --------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.internal or func in _META_QUERIES:
            return func(*args, **kwargs)
        self.last_op = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        packet = func.overloadpacket
        if packet not in self.registry and func is not torch.ops.prim.device.default:
            with self:
                r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        out = func(*args, **kwargs)
        n = self.registry[packet](*args, **kwargs, out_val=out) if packet in self.registry else 0
        if self.phase == "bwd":
            i, tp = self._bwd_layer()
            if self.layers:
                acc = self.layers[i].acc
                acc.bwd += n
                if tp:
                    acc.bwd_tp += n
                if packet in _flops.ATTENTION_BWD:
                    acc.attn_bwd += n
            return out
        acc = self.acc()
        acc.fwd += n
        if self.phase == "loss":
            acc.loss_flops += n
        if self.tp_depth:
            acc.fwd_tp += n
        if packet in _flops.ATTENTION_FWD:
            acc.attn_fwd += n
        if self.phase == "fwd":
            self._track(args, kwargs, out)
            if self.rec is not None:
                self.rec.op(func, packet, args, kwargs, out, n, self.current)
            if n and packet in _GEMMS:
                w = args[_GEMMS[packet]]
                if isinstance(w, torch.Tensor) and w.dim() >= 2:
                    if packet is torch.ops.aten.convolution:  # [out, in/groups, *kernel]
                        k_in, n_out = math.prod(w.shape[1:]), w.shape[0]
                    else:  # the weight-side operand [..., in, out]
                        k_in, n_out = w.shape[-2], w.shape[-1]
                    acc.gemm_flops += n
                    acc.gemm_logdim += n * 0.5 * math.log(max(1, k_in * n_out))
            elif not n and not func.is_view and packet not in _flops.ATTENTION_FWD:
                acc.mem += self._traffic(func, args, kwargs, out)
        return out

    def acc(self) -> Acc:
        """The accumulator of the layer running (before the first layer: kept for it)."""
        return self.layers[self.current].acc if self.layers else self.pre

    def _traffic(self, func: Any, args: tuple, kwargs: dict, out: Any) -> float:
        """HBM bytes of a memory-bound op: what it reads (a parameter: at most what it writes, e.g. an
        embedding lookup) and writes; 0 for ops returning an alias of an input (views)."""
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not func._schema.is_mutable and {storage_key(t) for t in outs} & {storage_key(t) for t in ins}:
            return 0.0
        written = sum(t.numel() * t.element_size() for t in outs)
        read = 0.0
        for t in ins:
            b = min(t.numel() * t.element_size(), storage_bytes(t))
            read += min(b, written) if storage_key(t) in self.state_keys else b
        return read + written

    def note_sdpa(self, query: Any = None, key: Any = None, value: Any = None, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, *args: Any, **kwargs: Any) -> None:
        if self.phase != "fwd" or not isinstance(query, torch.Tensor):
            return
        acc = self.acc()
        acc.head_dim = int(query.shape[-1])
        acc.causal = acc.causal or bool(is_causal)
        if isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad:
            acc.sdpa_unfused += 1

    def _track(self, args: tuple, kwargs: dict, out: Any) -> None:
        cur = self.current
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                k = storage_key(t)
                if k in self.producer:
                    self.consumer[k] = cur
                elif k in self.state_keys and k not in self.first_use:
                    self.first_use[k] = cur
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                k = storage_key(t)
                if k is not None and k not in self.producer and k not in self.state_keys and k not in self.buffer_keys:
                    self.producer[k] = cur
                    self.nbytes[k] = storage_bytes(t)
                    if self.rec is not None:
                        self.nbytes2[k] = storage_bytes(t) * self.rec.scale(t)
                    self.keep.append(t.untyped_storage())

    # -- saved tensors ---------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.internal or self.phase not in ("fwd", "loss"):
            return t
        k = storage_key(t)
        if k is None or k in self.state_keys or k in self.buffer_keys or k in self.saved_seen:
            return t
        self.saved_seen.add(k)
        self.keep.append(t.untyped_storage())
        b = storage_bytes(t)
        acc = self.acc()
        if self.phase == "loss":  # the loss is modelled apart (from the last layer's output)
            acc.loss_saved += b
            return t
        acc.saved += b
        if self.rec is not None:
            self.rec.saved(self.current, t, k)
        if self.tp_depth and k not in self.tp_inputs:
            acc.tp_saved += b
        return t

    # -- layer hooks -----------------------------------------------------------------------------
    def pre_hook(self, unit: Unit) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.phase != "fwd":
                return None
            call = self.calls.get(id(unit), 0)
            self.calls[id(unit)] = call + 1
            owned = []
            for p in module.parameters():
                if id(p) not in self.owned:
                    self.owned.add(id(p))
                    owned.append(p)
            name = unit.aliases[call] if call < len(unit.aliases) else f"{unit.name}@{call + 1}"
            rec = LayerRec(index=len(self.layers), unit=unit, name=name, call=call, owned=owned)
            rec.key = self.key_fn(rec, args, kwargs)
            self.bounds.append(self.seq())
            self.layers.append(rec)
            if rec.index == 0:
                rec.acc, self.pre = self.pre, Acc()
            self.stack.append(rec.index)
            self.current = rec.index
            if self.rec is not None:
                self.rec.layer_input(rec.index, args, kwargs)
            return None
        return hook

    def post_hook(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if self.phase != "fwd" or not self.stack:
            return None
        first = next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
        self.layers[self.stack[-1]].out_bytes = 0.0 if first is None else float(first.numel() * first.element_size())
        if self.rec is not None:
            self.rec.layer_output(self.stack[-1], out)
        self.stack.pop()
        if self.stack:
            self.current = self.stack[-1]
        return None

    def tp_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.phase == "fwd":
            self.tp_depth += 1
            if self.tp_depth == 1:
                self._tp_start = self.seq()
                self.tp_inputs = {storage_key(t) for t in tree_flatten((args, kwargs))[0]
                                  if isinstance(t, torch.Tensor)}

    def tp_post(self, module: nn.Module, args: tuple, out: Any) -> None:
        if self.phase == "fwd" and self.tp_depth:
            self.tp_depth -= 1
            if self.tp_depth == 0:
                self.tp_starts.append(self._tp_start)
                self.tp_ends.append(self.seq())

    # -- repeated blocks -------------------------------------------------------------------------
    def wrap(self, unit: Unit) -> Callable:
        orig = unit.module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.phase != "fwd" or not self.layers:
                return orig(*args, **kwargs)
            rec = self.layers[self.current]
            done = self.measured.setdefault(rec.key, [])
            if len(done) >= 2 and self.copy_blocks:
                out = self._passthrough(rec, self.layers[done[1]], args, kwargs)
                if out is not None:
                    return out
            in_leaves, in_spec = tree_flatten((args, kwargs))
            out = orig(*args, **kwargs)
            done.append(rec.index)
            if len(done) == 2:
                rec.io = self._io_plan(rec, in_leaves, in_spec, out)
            return out

        return forward

    def _io_plan(self, rec: LayerRec, in_leaves: list, in_spec: Any, out: Any) -> Any:
        out_leaves, out_spec = tree_flatten(out)
        tensors = [i for i, t in enumerate(in_leaves) if isinstance(t, torch.Tensor)]
        primary = next((i for i in tensors if in_leaves[i].is_floating_point()), None)
        plan: list[tuple[str, Any]] = []
        used_primary = False
        for t in out_leaves:
            if not isinstance(t, torch.Tensor):
                plan.append(("const", t))
                continue
            same = next((i for i in tensors if in_leaves[i] is t), None)
            if same is not None:
                plan.append(("in", same))
            elif (primary is not None and not used_primary and t.shape == in_leaves[primary].shape
                  and t.dtype == in_leaves[primary].dtype):
                plan.append(("in", primary))
                used_primary = True
            else:
                return None  # an output we cannot re-wire: run every call of this block
        consumed = [isinstance(t, torch.Tensor) and self.consumer.get(storage_key(t)) == rec.index
                    for t in in_leaves]
        return in_spec, [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in in_leaves], \
            out_spec, plan, consumed

    def _passthrough(self, rec: LayerRec, rep: LayerRec, args: tuple, kwargs: dict) -> Any:
        if rep.io is None:
            return None
        in_spec, shapes, out_spec, plan, consumed = rep.io
        leaves, spec = tree_flatten((args, kwargs))
        if spec != in_spec or len(leaves) != len(shapes):
            return None
        for t, s in zip(leaves, shapes):
            if isinstance(t, torch.Tensor) != (s is not None) or (s is not None and (tuple(t.shape), t.dtype) != s):
                return None
        for t, c in zip(leaves, consumed):
            if c:
                k = storage_key(t)
                if k in self.producer:
                    self.consumer[k] = rec.index
        rec.copy_of = rep.index
        return tree_unflatten([leaves[v] if kind == "in" else v for kind, v in plan], out_spec)


def user_frame(tb: Any) -> str:
    """file:line (function) of the innermost frame outside torch and meshplan.ingest."""
    skip = (str(Path(torch.__file__).parent), str(Path(__file__).parent))
    found = ""
    for fs in traceback.extract_tb(tb):
        if not fs.filename.startswith(skip) and "/contextlib.py" not in fs.filename:
            found = f"{fs.filename}:{fs.lineno} in {fs.name}"
    return found


def trace_error(source: str, tracer: Tracer, e: BaseException) -> MeshplanError:
    layer = (tracer.layers[tracer.current].name if tracer.layers
             else f"{type(tracer.model).__name__}.forward, before its first layer")
    where = user_frame(e.__traceback__ or sys.exc_info()[2])
    at = f" at {where}" if where else ""
    if isinstance(e, ValueRead):
        what = str(e)
        detail = "meta tensors have no values"
    else:
        what = f"aten.{tracer.last_op}" if tracer.last_op else type(e).__name__
        lines = str(e).strip().splitlines()
        detail = f"{type(e).__name__}: {lines[0][:160] if lines else ''}"
    phase = "backward" if tracer.phase == "bwd" else "loss" if tracer.phase == "loss" else "forward"
    meta = isinstance(e, ValueRead) or any(w in str(e) for w in ("meta", "data-dependent", "data dependent"))
    hint = _TRACE_HINT if meta else "check that the model runs on CPU with the same inputs (build(source).step(...))"
    return MeshplanError(f"cannot trace {source} on the meta device: {what} in {layer!r} ({phase}){at}: "
                         f"{detail}", hint=hint)


def run(tracer: Tracer, source: str, forward: Callable[[], Any], loss_of: Callable[[Any], torch.Tensor]) -> None:
    """``loss_of(forward())`` and its backward under the instruments; errors -> MeshplanError."""
    hooks = []
    wrapped = []
    try:
        for u in tracer.units:
            hooks.append(u.module.register_forward_pre_hook(tracer.pre_hook(u), with_kwargs=True))
            hooks.append(u.module.register_forward_hook(tracer.post_hook, with_kwargs=True, always_call=True))
            if u.in_container:
                wrapped.append((u.module, "forward" in vars(u.module), vars(u.module).get("forward")))
                u.module.forward = tracer.wrap(u)
        for mods in tracer.tp_regions.values():
            for m in mods:
                hooks.append(m.register_forward_pre_hook(tracer.tp_pre, with_kwargs=True))
                hooks.append(m.register_forward_hook(tracer.tp_post, always_call=True))
        try:
            with torch.device("meta"), _FunctionGuard(tracer), tracer, \
                    torch.autograd.graph.saved_tensors_hooks(tracer.pack, lambda t: t):
                tracer.phase = "fwd"
                outputs = forward()
                tracer.phase = "loss"
                loss = loss_of(outputs)
                tracer.phase = "bwd"
                if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                    raise MeshplanError(f"{source}: the loss does not depend on any parameter",
                                        hint="return a scalar computed from the model's outputs")
                loss.backward()
                tracer.phase = "idle"
        except MeshplanError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure inside user/library code becomes one line
            raise trace_error(source, tracer, e) from None
    finally:
        tracer.phase = "idle"
        for h in hooks:
            h.remove()
        for m, had, old in wrapped:
            if had:
                m.forward = old
            else:
                del m.forward


def frontier(tracer: Tracer, nbytes: dict[int, float] | None = None) -> list[float]:
    """Bytes crossing the cut after each layer: storages made at or before it and read after it
    (``nbytes``: each storage's bytes; default: as traced)."""
    sizes = tracer.nbytes if nbytes is None else nbytes
    n = len(tracer.layers)
    diff = [0.0] * (n + 1)
    for k, p in tracer.producer.items():
        c = tracer.consumer.get(k)
        if c is not None and c > p:
            diff[p] += sizes.get(k, 0.0)
            diff[c] -= sizes.get(k, 0.0)
    out, run_sum = [], 0.0
    for i in range(n):
        run_sum += diff[i]
        out.append(run_sum)
    return out
