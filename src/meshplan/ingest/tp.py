"""Megatron tensor-parallel structure of a block, from the names of its weight matrices.

A *column* matrix (q/k/v, gate/up, c_attn, c_fc, query/key/value, wi, fc1 ...) is split by output
features, a *row* matrix (o, down, c_proj, dense, wo, fc2 ...) by input features; a set of column
matrices and the row matrix of the same parent module (else: a run of column matrices closed by a
row matrix, in parameter-registration order) is one pair: one all-reduce of the layer's output
forward and one backward. The experts of a MoE layer (pairs under one ModuleList/ModuleDict, or one
fused ``gate_up_proj``/``down_proj`` module) share one all-reduce. Recognised names (case-insensitive, the module's name
or, for fused parameters such as MoE experts' ``gate_up_proj``, the parameter's) are listed in
COLUMN and ROW; a ``dense`` under a module named ``intermediate`` (BERT, ViT) is a column matrix.

What is split is what meshplan's runtime splits (runtime/generic.py reads the same TPInfo, so the
two cannot disagree): a pair only when all its matrices are ``nn.Linear`` weights that are not fused
(FUSED: qkv_proj, c_attn, gate_up_proj ...; MoE experts' 3-D parameters; GPT-2's Conv1D); the
others stay whole (``kept``). A block whose attention pair stays whole is not split at all (the cost
model divides every attention's heads by tp), and then no layer of the model is (``model_tp``).
Under TP the LM head and the embedding tables of its vocabulary are vocabulary-parallel
(``model_tp``): the head a column-split nn.Linear whose logits stay sharded (the loss under
``loss_parallel``), the tables (exactly ``nn.Embedding``) split by rows, a tied pair alike.

Convolutions (issue 29): in a block, two ``nn.Conv1d/2d/3d`` (exactly those classes, groups 1) of
the same parent module, registered one after the other with only channel-wise modules between them
(BatchNorm of the first one's output channels, activations, dropout, identity), the first's output
channels the second's input channels, are a pair too (``conv_pairs``): the first split by output
channels (column), the second by input channels (row; its partial outputs all-reduced, its bias added
once after), the BatchNorm between them split with the column's channels; a BatchNorm after the row
convolution stays whole (its input is all-reduced). Each pair is one all-reduce of the row
convolution's output (not of the block's output: ``TPInfo.conv_rows``). ResNet's bottleneck pairs
conv1 -> conv2 (conv3 and the shortcut stay whole), a basic or Wide-ResNet block conv1 -> conv2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

COLUMN = frozenset({
    "q_proj", "k_proj", "v_proj", "qkv_proj", "q", "k", "v", "query", "key", "value", "c_attn", "qkv", "wqkv",
    "query_key_value", "wq", "wk", "wv", "in_proj", "gate_proj", "up_proj", "gate_up_proj", "w1", "w3", "c_fc",
    "fc1", "fc_in", "wi", "wi_0", "wi_1", "dense_h_to_4h", "lin1", "linear1", "q_lin", "k_lin", "v_lin",
    "q_b_proj", "kv_b_proj",
})
ROW = frozenset({
    "o_proj", "o", "out_proj", "c_proj", "dense", "down_proj", "w2", "wo", "fc2", "fc_out", "dense_4h_to_h",
    "proj", "lin2", "linear2", "out_lin",
})
ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "q", "k", "v", "query", "key", "value", "c_attn",
                       "qkv", "wqkv", "query_key_value", "wq", "wk", "wv", "in_proj", "q_lin", "k_lin", "v_lin",
                       "q_b_proj", "kv_b_proj"})
HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_head", "n_heads")
KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "kv_heads")
FUSED = frozenset({"qkv_proj", "c_attn", "qkv", "wqkv", "query_key_value", "gate_up_proj", "in_proj"})
"""Column matrices that hold several projections side by side: a column split would mix them (kept whole)."""
LM_TASKS = ("causal-lm", "masked-lm", "seq2seq-lm")
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
"""Convolutions TP splits by channels (exactly these classes: a subclass may compute otherwise)."""
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
"""Channel norms that split with a column convolution's output channels (per-channel statistics)."""
CHANNELWISE = (*NORMS, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Hardswish, nn.Mish,
               nn.Tanh, nn.Sigmoid, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
"""Modules that may sit between the two convolutions of a pair: each output channel depends on the
same input channel only."""
"""Tasks whose head is a vocabulary projection: vocabulary-parallel under TP."""


@dataclass
class _Matrix:
    module: str  # owner module path inside the block
    leaf: str
    role: str  # column | row
    in_width: int
    out_width: int
    numel: int
    param: str = ""
    """The parameter's name inside the block (``mlp.up_proj.weight``, ``experts.gate_up_proj``)."""

    @property
    def scope(self) -> str:
        """The module the pair lives in: the owner's parent (a fused parameter: its owner)."""
        if self.leaf != self.module.rsplit(".", 1)[-1]:
            return self.module
        return self.module.rsplit(".", 1)[0] if "." in self.module else ""


@dataclass
class TPInfo:
    style: str = "none"
    pairs: int = 0
    """All-reduces per pass: column->row pairs, the experts of one MoE layer counted once."""
    param_fraction: float = 0.0
    tp_max: int = 1
    regions: list[str] = field(default_factory=list)
    """Module paths (inside the block) whose work TP divides."""
    notes: list[str] = field(default_factory=list)
    roles: dict[str, str] = field(default_factory=dict)
    """Parameter name inside the block -> column | row, for the matrices of the pairs (ingest/ops.py
    splits their GEMMs; the biases of column matrices split with them)."""
    attention: set[str] = field(default_factory=set)
    """Of ``roles``: the matrices of attention pairs (their widths are the heads')."""
    modules: dict[str, str] = field(default_factory=dict)
    """Module path (nn.Linear) -> column | row: what the runtime's ColwiseParallel/RowwiseParallel split."""
    attention_scopes: list[str] = field(default_factory=list)
    """Modules holding the split attention projections (their head counts are divided by tp)."""
    kept: list[str] = field(default_factory=list)
    """Recognised matrices kept whole, and why (one line each)."""
    attention_kept: bool = False
    """An attention pair is kept whole: TP cannot split this model's attention."""
    convs: dict[str, str] = field(default_factory=dict)
    """Convolution pairs (``conv_pairs``): module path -> column | row for the convolutions, channel
    for the BatchNorms between them (split with the column's output channels)."""
    conv_pairs: int = 0
    """Of ``pairs``: the convolution pairs (each all-reduces its row convolution's output)."""


def _role(owner: str, leaf: str) -> str | None:
    name = leaf.lower()
    parent = owner.rsplit(".", 2)[-2] if owner.count(".") >= 1 else ""
    if name == "dense" and parent.lower() == "intermediate":
        return "column"
    if name in COLUMN:
        return "column"
    if name in ROW:
        return "row"
    return None


def _widths(module: nn.Module, pname: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(in, out) features of a weight matrix."""
    if type(module).__name__ == "Conv1D" and len(shape) == 2:  # GPT-2's transposed linear [in, out]
        return shape[0], shape[1]
    if pname == "weight" and type(module) in CONVS:
        return module.in_channels, module.out_channels
    if pname == "weight" and isinstance(getattr(module, "in_features", None), int):
        return module.in_features, module.out_features
    return shape[-1], shape[-2]  # [out, in] or fused experts [E, out, in]


def _matrices(block: nn.Module) -> list[_Matrix]:
    out = []
    for mod_name, mod in block.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if p.dim() < 2:
                continue
            if pname == "weight":
                leaf = mod_name.rsplit(".", 1)[-1] if mod_name else ""
            else:
                leaf = pname[:-len("_weight")] if pname.endswith("_weight") else pname
            role = _role(mod_name, leaf)
            if role is not None:
                w_in, w_out = _widths(mod, pname, tuple(p.shape))
                out.append(_Matrix(mod_name, leaf, role, w_in, w_out, p.numel(),
                                   f"{mod_name}.{pname}" if mod_name else pname))
    return out


def _runs(mats: list[_Matrix]) -> tuple[list[list[_Matrix]], list[_Matrix]]:
    """Column runs closed by a row matrix, in registration order; also the matrices left over."""
    pairs, run, left = [], [], []
    for m in mats:
        if m.role == "column":
            run.append(m)
        elif run:
            pairs.append([*run, m])
            run = []
        else:
            left.append(m)
    return pairs, left + run


def _pairs(mats: list[_Matrix]) -> list[list[_Matrix]]:
    """Pairs within one scope first (any order of registration: w1, w2, w3), then the rest in order
    (BERT's attention.self.query ... attention.output.dense)."""
    scopes: dict[str, list[_Matrix]] = {}
    for m in mats:
        scopes.setdefault(m.scope, []).append(m)
    pairs, rest = [], []
    for group in scopes.values():
        rows = [m for m in group if m.role == "row"]
        cols = [m for m in group if m.role == "column"]
        if len(rows) == 1 and cols:
            pairs.append([*cols, rows[0]])
        elif len(rows) > 1 and cols:
            found, left = _runs(group)
            pairs += found
            rest += left
        else:
            rest += group
    rest.sort(key=lambda m: mats.index(m))
    pairs += _runs(rest)[0]
    return pairs


def _lca(paths: list[str]) -> str:
    split = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _heads(block: nn.Module, config_heads: tuple[int | None, int | None],
           pairs: list[list[_Matrix]]) -> tuple[int | None, int | None]:
    heads, kv = config_heads
    if heads is not None:
        return heads, kv or heads
    mods = dict(block.named_modules())
    for _n, m in mods.items():
        if isinstance(m, nn.MultiheadAttention):
            return m.num_heads, m.num_heads
        h = next((getattr(m, a) for a in HEAD_ATTRS if isinstance(getattr(m, a, None), int)), None)
        if h:
            k = next((getattr(m, a) for a in KV_ATTRS if isinstance(getattr(m, a, None), int)), None)
            return h, k or h
    for pair in pairs:  # a head_dim attribute on the attention module: heads from the q / k widths
        d = getattr(mods.get(pair[-1].scope), "head_dim", None)
        if isinstance(d, int) and d > 0:
            q = next((m.out_width for m in pair if m.leaf.lower() in ("q", "q_proj", "query", "wq")), None)
            k = next((m.out_width for m in pair if m.leaf.lower() in ("k", "k_proj", "key", "wk")), None)
            if q and q % d == 0:
                return q // d, (k // d if k and k % d == 0 else q // d)
    return None, None


def analyse(block: nn.Module, config_heads: tuple[int | None, int | None] = (None, None)) -> TPInfo:
    """The TP structure of one block (a unit's module)."""
    mods = dict(block.named_modules())
    pairs = _pairs(_matrices(block))
    info = TPInfo()
    kept = []
    for pair in pairs:
        bad = next((m for m in pair if _whole(m, mods)), None)
        if bad is not None:
            kept.append(pair)
            why = "fused" if bad.leaf.lower() in FUSED or bad.leaf != bad.module.rsplit(".", 1)[-1] \
                else f"a {type(mods.get(bad.module)).__name__}, not an nn.Linear"
            info.kept.append(f"{bad.param} is {why}: kept whole")
            if any(m.leaf.lower() in ATTENTION for m in pair[:-1]):
                info.attention_kept = True
    if info.attention_kept:  # the attention is not split: neither is the block
        return info
    pairs = [p for p in pairs if p not in kept]
    convs = conv_pairs(block)
    if not pairs:
        if convs:
            _add_convs(info, block, convs)
        return info
    # one all-reduce per MoE layer: its experts (pairs under one ModuleList/ModuleDict, or fused
    # expert parameters) and any other pair beside them (a shared expert) are summed first
    def parent(path: str) -> str:
        return path.rsplit(".", 1)[0] if "." in path else ""

    moe: set[str] = set()
    for pair in pairs:
        scope = pair[-1].scope
        if isinstance(mods.get(parent(scope)), (nn.ModuleList, nn.ModuleDict)):
            moe.add(parent(parent(scope)))
        elif pair[-1].leaf != pair[-1].module.rsplit(".", 1)[-1] and mods[pair[-1].module] is not block:
            moe.add(parent(scope))  # fused experts: the MoE module holding them
    groups: set[str] = set()
    for i, pair in enumerate(pairs):
        attention = any(m.leaf.lower() in ATTENTION for m in pair[:-1])
        up = [p for p in moe if pair[-1].scope == p or pair[-1].scope.startswith(p + ".") or p == ""]
        groups.add(f"moe:{max(up, key=len)}" if up and not attention else f"pair:{i}")
    info.style, info.pairs = "megatron", len(groups)
    caps: list[int] = []
    heads, kv = _heads(block, config_heads, pairs)
    owners: set[str] = set()
    for pair in pairs:
        row = pair[-1]
        owners |= {m.module for m in pair}
        attn = any(m.leaf.lower() in ATTENTION for m in pair[:-1])
        for m in pair:
            info.roles[m.param] = m.role
            info.modules[m.module] = m.role
            if attn:
                info.attention.add(m.param)
                scope = m.module.rsplit(".", 1)[0] if "." in m.module else ""
                if m.role == "column" and scope not in info.attention_scopes:
                    info.attention_scopes.append(scope)
        if attn:
            if heads:  # multi-query (one k/v head): the k/v head is replicated on every rank
                caps += [heads] if kv == 1 else [heads, kv or heads]
            else:
                caps.append(row.in_width)
                info.notes.append(f"attention heads unknown: TP degree bounded by width {row.in_width}")
        else:
            caps.append(row.in_width)
        lca = _lca([m.module for m in pair])
        info.regions += [lca] if lca else sorted({m.module for m in pair})
    info.tp_max = math.gcd(*caps) if caps else 1
    # keep the outermost regions only (nested ones would be counted twice)
    regions = sorted(set(info.regions), key=lambda r: (r.count("."), r))
    info.regions = [r for r in regions if not any(r != o and r.startswith(o + ".") for o in regions)]
    split = sum(p.numel() for p in {id(p): p for o in owners for p in mods[o].parameters()}.values())
    total = sum(p.numel() for p in block.parameters())
    info.param_fraction = min(1.0, split / total) if total else 0.0
    if convs:
        _add_convs(info, block, convs)
    return info


@dataclass
class ConvPair:
    column: str
    row: str
    norms: list[str]
    """The BatchNorms between them (split with the column's output channels)."""


def conv_pairs(block: nn.Module) -> list[ConvPair]:
    """The convolution pairs of a block (see the module docstring): leaf modules in registration
    order; a convolution and the next one, of the same parent, with only CHANNELWISE modules between
    them (BatchNorms of the first's output channels), the first's output channels the second's input
    channels, both of one class (Conv1d/2d/3d exactly, groups 1); pairs do not overlap."""
    leaves = [(n, m) for n, m in block.named_modules() if n and next(m.children(), None) is None]
    out: list[ConvPair] = []
    used: set[str] = set()

    def parent(path: str) -> str:
        return path.rsplit(".", 1)[0] if "." in path else ""

    for i, (name, a) in enumerate(leaves):
        if type(a) not in CONVS or a.groups != 1 or name in used:
            continue
        j = next((j for j in range(i + 1, len(leaves)) if type(leaves[j][1]) in CONVS), None)
        if j is None:
            continue
        rname, b = leaves[j]
        between = leaves[i + 1:j]
        if (type(b) is not type(a) or b.groups != 1 or parent(rname) != parent(name)
                or b.in_channels != a.out_channels
                or any(type(m) not in CHANNELWISE for _, m in between)
                or any(type(m) in NORMS and m.num_features != a.out_channels for _, m in between)):
            continue
        out.append(ConvPair(name, rname, [n for n, m in between if type(m) in NORMS]))
        used |= {name, rname}
    return out


def _add_convs(info: TPInfo, block: nn.Module, convs: list[ConvPair]) -> None:
    """Add the convolution pairs to a block's split (one all-reduce each; TP divides the row
    convolutions' input channels)."""
    mods = dict(block.named_modules())
    caps = [info.tp_max] if info.style == "megatron" else []
    owners: set[str] = set()
    for c in convs:
        for path, role in ((c.column, "column"), (c.row, "row"), *((n, "channel") for n in c.norms)):
            info.convs[path] = role
            owners.add(path)
            if role != "channel":
                info.roles[f"{path}.weight"] = role
        caps.append(mods[c.row].in_channels)
        info.regions += [c.column, c.row]
    info.style = "megatron"
    info.pairs += len(convs)
    info.conv_pairs = len(convs)
    info.tp_max = math.gcd(*caps)
    regions = sorted(set(info.regions), key=lambda r: (r.count("."), r))
    info.regions = [r for r in regions if not any(r != o and r.startswith(o + ".") for o in regions)]
    linear = info.param_fraction * sum(p.numel() for p in block.parameters())
    split = sum(p.numel() for o in owners for p in mods[o].parameters())
    total = sum(p.numel() for p in block.parameters())
    info.param_fraction = min(1.0, (linear + split) / total) if total else 0.0


def _whole(m: _Matrix, mods: dict[str, nn.Module]) -> bool:
    """The runtime keeps this matrix whole: fused, a parameter of its own (MoE experts' 3-D
    ``gate_up_proj``), or not an nn.Linear (GPT-2's Conv1D)."""
    return (m.leaf.lower() in FUSED or m.leaf != m.module.rsplit(".", 1)[-1]
            or not isinstance(mods.get(m.module), nn.Linear))


@dataclass
class ModelTP:
    """What tensor parallelism splits in a whole model (ingest marks it, the runtime splits it)."""

    blocks: dict[str, TPInfo] = field(default_factory=dict)
    """Path of each repeated block -> its split (style "none": kept whole)."""
    head: str | None = None
    """Path of the LM head (an nn.Linear to the vocabulary), column-split with sharded logits."""
    tables: list[str] = field(default_factory=list)
    """Paths of the vocabulary-parallel embedding tables (nn.Embedding with the head's rows)."""
    tied: bool = False
    """The head's weight is one of the tables' (both split by vocabulary rows alike)."""
    notes: list[str] = field(default_factory=list)
    refusal: str | None = None
    """Why tp > 1 cannot run on this model (None: it can)."""

    @property
    def splits(self) -> bool:
        return self.refusal is None


def lm_head(model: nn.Module, task: str) -> tuple[str, nn.Linear] | None:
    """The LM head of a language model: ``get_output_embeddings()`` (Hugging Face), else a root
    attribute ``lm_head``/``output``; an nn.Linear. None for other tasks (classification heads stay whole)."""
    if task not in LM_TASKS:
        return None
    head: Any = None
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except (AttributeError, NotImplementedError):
            head = None
    if head is None:
        head = next((getattr(model, a) for a in ("lm_head", "output")
                     if isinstance(getattr(model, a, None), nn.Module)), None)
    if not isinstance(head, nn.Linear):
        return None
    path = next((n for n, m in model.named_modules() if m is head), None)
    return (path, head) if path else None


def model_tp(model: nn.Module, blocks: list[tuple[str, nn.Module]], heads: tuple[int | None, int | None],
             task: str, name: str) -> ModelTP:
    """The TP split of ``model`` whose repeated blocks are ``blocks`` (path, module): each block's
    pairs the runtime splits (``analyse``); nothing when an attention stays whole (fused or Conv1D
    q/k/v: GPT-2, Phi-3, Falcon ...); else the LM head and its vocabulary's embedding tables
    (vocabulary-parallel). ``refusal`` when no block is split."""
    out = ModelTP()
    cache: dict[int, TPInfo] = {}
    for _path, m in blocks:
        if id(m) not in cache:
            cache[id(m)] = analyse(m, heads)
    by_path = {path: cache[id(m)] for path, m in blocks}
    for info in cache.values():
        for k in info.kept:
            if k not in out.notes:
                out.notes.append(k)
    whole = next((i for i in cache.values() if i.attention_kept), None)
    if whole is not None:
        why = next(k for k in whole.kept)
        out.blocks = {path: TPInfo() for path in by_path}
        out.refusal = (f"tp>1: {name}'s attention projections cannot be split by this runtime ({why}), so "
                       "no layer of it is; use tp=1")
        out.notes.append("tensor parallel: none (an attention projection is kept whole)")
        return out
    out.blocks = by_path
    if not any(i.style == "megatron" for i in cache.values()):
        out.refusal = (f"tp>1: no block of {name} has attention/MLP matrices this runtime can split (nn.Linear "
                       "q/k/v/o, gate/up/down, fc1/fc2 ...) nor a pair of convolutions (conv -> BatchNorm/"
                       "activation -> conv, the channels in between split); use tp=1")
        return out
    found = lm_head(model, task)
    if found is not None:
        out.head, head = found
        rows = head.out_features
        seen: set[int] = set()
        for path, m in model.named_modules():
            if type(m) is nn.Embedding and m.num_embeddings == rows and id(m) not in seen:
                seen.add(id(m))
                out.tables.append(path)
                out.tied = out.tied or m.weight is head.weight
    return out
