"""The training loop: one optimizer step per global batch, on any plan and any model.

``Trainer`` runs in one process (no process group: the reference) or on every rank of a
torchrun job. What is particular to a kind of model is its ``TrainModel``: ``PresetModel`` here (a
Transformer from a ModelSpec, byte-level text), ``generic.IngestedModel`` for ``hf:``/``module:``
sources (ingestion's module, synthetic batches of its example inputs, its own loss). Both are
parallelised with the same pieces (parallelize.py) and trained by the same loop, data-parallel
gradient sync, clipping, metrics and checkpoints (checkpoint.py).

The loss of a step is the mean loss over the global batch, the same number on every plan: each
micro-batch loss is a mean over equally many rows (tokens), averaged over micro-batches (gradient
accumulation, or the pipeline schedule's ``scale_grads``) and over data-parallel ranks (DDP/FSDP
average their gradient reductions). Where micro-batches are not alike (runtime/hetero.py), each
micro-batch's loss is weighted instead (``Trainer._mb_weight``; pipeline schedules then sum, not
average, their micro-batches' gradients): uneven ``dp_shares`` by dp x micro_batch / global batch,
variable-length samples by dp x cp x its real tokens / the global batch's real tokens, so that the
data-parallel average is the mean over the whole global batch (its real tokens).

Bucket plans (``Plan.buckets``, spec/buckets.py; presets, pp = 1): every rank forms the step's
micro-batches and their units from the step's lengths (``hetero.bucket_step``) and runs its own
list in order (``Trainer._bucket_forward_backward``), each with its cp degree switched on for its
forward and backward (``Parallelized.sequence``), weighted by real tokens as above. Ranks run
different numbers of micro-batches, so every one runs without data-parallel gradient sync and the
step ends with a one-token pass weighted 0 on every rank that carries the reduction.
"""
from __future__ import annotations

import contextlib
import logging
import os
import resource
import sys
import time
import typing
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshplan.errors import MeshplanError
from meshplan.ingest.batch import Batch
from meshplan.runtime import data as data_mod
from meshplan.runtime import hetero
from meshplan.runtime.context_parallel import shard_sequence
from meshplan.runtime.data import take
from meshplan.runtime.expert_parallel import is_expert_param
from meshplan.runtime.generic import IngestedModel
from meshplan.runtime.mesh import RuntimeMesh
from meshplan.runtime.models import build_model, loss_fn
from meshplan.runtime.parallelize import VOCAB_PARAMS, Parallelized, logical_name, parallelize
from meshplan.runtime.periodic import OuterSync, compression_of
from meshplan.runtime.run_config import RunConfig, TrainModel
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import RUNTIME_OPTIMIZERS, Plan, checked_microbatches

log = logging.getLogger(__name__)

ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
"""AdamW settings of Llama/GPT-3 pre-training; lr comes from the run config."""
SGD = {"momentum": 0.9}
"""--optimizer sgd: SGD with (heavy-ball) momentum 0.9, no weight decay; lr from the run config."""
ADAFACTOR: dict[str, Any] = {}
"""--optimizer adafactor: torch.optim.Adafactor with torch's defaults (beta2_decay -0.8, eps (None,
1e-3), d 1, no weight decay; factored second moment, no first moment); lr from the run config."""
OPTIMIZERS = RUNTIME_OPTIMIZERS
FAIL_ENV = "MESHPLAN_FAIL_AT"
"""Fault injection for tests: 'RANK:STEP' makes that rank exit hard once STEP steps are done (first attempt only)."""


def rank_microbatches(cfg: RunConfig, dp_rank: int = 0) -> int:
    """Micro-batches per step of data-parallel replica ``dp_rank`` (uneven dp_shares: its own count)."""
    if cfg.plan.dp_shares is None:
        return checked_microbatches(cfg.plan, cfg.global_batch)
    return hetero.replica_microbatches(cfg.plan, cfg.global_batch)[dp_rank]


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")
"""Attributes checkpoint_wrapper and torch.compile put in parameter names."""
OUTER = ("module.", "inner.")
"""Prefixes of parameter names from the outside of a model: DDP's wrapper, an ingested pipeline
stage (``generic.StageModule.inner``)."""


def clean_fqn(name: str) -> str:
    """Parameter name without wrapper prefixes (checkpoint_wrapper, DDP, torch.compile, a pipeline
    stage of an ingested model): its name in the single-process model."""
    for junk in WRAPPERS:
        name = name.replace(junk, "")
    for outer in OUTER:
        if name.startswith(outer):
            name = name[len(outer):]
    return name


@dataclass(frozen=True)
class BucketRun:
    """One micro-batch of a bucket plan as this rank runs it (``PresetModel.bucket_runs``)."""

    batch: Batch
    """This rank's rows: the whole padded samples (cp 1), or its two chunks of them."""
    cp: int
    index: int
    """This rank's index in the micro-batch's unit (0 for cp 1)."""
    width: int
    """The padded length of the whole samples (a multiple of 2 x cp when cp > 1)."""
    real: int
    """Real (not padding) target tokens of ``batch``: its weight (0: its loss is multiplied by 0)."""


class PresetModel(TrainModel):
    """A Transformer built from a ModelSpec (runtime/models.py): token ids in, next-token
    cross-entropy out; the vocabulary padded for tp and tied embeddings under a pipeline are its
    own (parallelize.py)."""

    def __init__(self, cfg: RunConfig) -> None:
        assert isinstance(cfg.model, ModelSpec)
        self.cfg, self.spec = cfg, cfg.model
        self.name = cfg.model.name
        self.lengths = cfg.lengths if cfg.lengths is not None and len(cfg.lengths.lengths) > 1 else None
        self.seq_len = self.lengths.max_len if self.lengths is not None else cfg.seq_len or cfg.model.seq_len
        self.sample_tokens = self.seq_len
        self.vocab_rows = cfg.model.vocab_size
        self.varied = self.lengths is not None and self.lengths.packing != "packed"
        self._widths: list[int] | None = None
        """With ``varied`` and no pipeline: each micro-batch's padded length this step."""
        self._cp: int | None = None
        """With ``varied``, a pipeline and cp > 1: this rank's cp index (its chunks of every row)."""
        from meshplan.spec.buckets import model_knee
        self.knee = model_knee(cfg.model)
        """Bucket plans: the attention knee the micro-batches are dealt by (spec.buckets.model_knee)."""

    def parallelize(self, plan: Plan, mesh: RuntimeMesh | None, device: torch.device,
                    microbatches: int) -> Parallelized:
        model = build_model(self.spec, self.seq_len, seed=self.cfg.seed)
        return parallelize(model, plan, mesh, device, microbatches=microbatches, seq_len=self.seq_len)

    def rank_batch(self, step: int, mesh: RuntimeMesh | None, device: torch.device) -> Batch:
        c = self.cfg
        dp_rank, dp = (mesh.dp_rank, mesh.dp) if mesh else (0, 1)
        if self.lengths is not None and self.lengths.packing == "packed":
            tokens = data_mod.packed_batch(step, batch=c.global_batch, dist=self.lengths, vocab=self.spec.vocab_size,
                                           seed=c.seed, source=c.data)
        else:
            tokens = data_mod.global_batch(step, batch=c.global_batch, seq_len=self.seq_len,
                                           vocab=self.spec.vocab_size, seed=c.seed, source=c.data)
        if self.varied:
            self._cp = mesh.cp_rank if mesh is not None and mesh.cp > 1 else None
            return self._varied_batch(tokens, step, dp_rank, device)
        span = hetero.replica_span(c.plan, c.global_batch, dp_rank) if c.plan.dp_shares is not None else None
        x, y = data_mod.rank_rows(tokens, dp_rank, dp, span)
        if mesh is not None and mesh.cp > 1:  # this cp rank's two chunks of every row
            x, y = (shard_sequence(t, mesh.cp, mesh.cp_rank) for t in (x, y))
        return Batch(args=(x.to(device),), targets=y.to(device))

    def _varied_batch(self, tokens: torch.Tensor, step: int, dp_rank: int, device: torch.device) -> Batch:
        """This replica's variable-length samples in its micro-batch order (hetero.step_layout),
        padded to the longest of the replica's micro-batches (``micro`` cuts each to its own
        longest), or under a pipeline to the longest length (the schedule needs one shape)."""
        c = self.cfg
        assert self.lengths is not None
        layout = hetero.step_layout(self.lengths, c.plan, c.global_batch, step, c.seed)
        self.step_tokens = layout.total_tokens
        mult = c.plan.tp if c.plan.sequence_parallel else 1  # sequence parallelism splits the sequence
        widths = [-(-w // mult) * mult for w in layout.padded_lengths(dp_rank)]
        width = self.seq_len if c.plan.pp > 1 else max(widths)
        self._widths = None if c.plan.pp > 1 else widths
        samples = [i for mb in layout.replicas[dp_rank] for i in mb]
        x, y = data_mod.padded_rows(tokens, layout.lengths, samples, width)
        if c.plan.pp > 1 and c.plan.cp > 1 and self._cp is not None:  # every row padded to the longest
            x, y = (shard_sequence(t, c.plan.cp, self._cp) for t in (x, y))  # length: cut like one length
        return Batch(args=(x.to(device),), targets=y.to(device))

    def bucket_runs(self, step: int, mesh: RuntimeMesh | None, device: torch.device) -> list[BucketRun]:
        """This rank's micro-batches of step ``step`` under a bucket plan, in run order
        (``hetero.bucket_step``: ``layout.ranks[d x C + c]``): the samples of each padded to its
        longest, rounded up to a multiple of 2 x cp (cp > 1; x tp with sequence parallelism), and cut
        to this rank's two chunks when cp > 1 (index in the unit = rank - unit x cp). A shard without
        a real target token (possible when the rounding pads a whole chunk) gets one target token 0
        and the weight 0: a finite loss, no gradient."""
        c = self.cfg
        assert self.lengths is not None
        layout = hetero.bucket_step(self.lengths, c.plan, c.global_batch, step, c.seed, self.knee)
        self.step_tokens = layout.total_tokens
        tokens = data_mod.global_batch(step, batch=c.global_batch, seq_len=self.seq_len, vocab=self.spec.vocab_size,
                                       seed=c.seed, source=c.data)
        me = mesh.dp_rank * mesh.cp + mesh.cp_rank if mesh is not None else 0
        tp = c.plan.tp if c.plan.sequence_parallel else 1  # sequence parallelism splits the sequence
        out = []
        for j in layout.ranks[me]:
            mb = layout.micro_batches[j]
            mult = (2 * mb.cp if mb.cp > 1 else 1) * tp
            width = -(-mb.width // mult) * mult
            x, y = data_mod.padded_rows(tokens, layout.lengths, list(mb.samples), width)
            index = me - mb.unit * mb.cp
            if mb.cp > 1:
                x, y = (shard_sequence(t, mb.cp, index) for t in (x, y))
            real = int((y != hetero.IGNORE).sum())
            if real == 0:
                y = y.clone()
                y[0, 0] = 0
            out.append(BucketRun(Batch(args=(x.to(device),), targets=y.to(device)), cp=mb.cp, index=index,
                                 width=width, real=real))
        return out

    def closing_batch(self, device: torch.device) -> Batch:
        """The step's closing pass under a bucket plan: one sample of one token (tp tokens with
        sequence parallelism), input and target token 0."""
        n = self.cfg.plan.tp if self.cfg.plan.sequence_parallel else 1
        z = torch.zeros((1, n), dtype=torch.long, device=device)
        return Batch(args=(z,), targets=z.clone())

    def micro(self, b: Batch, i: int, per: int, rows: int) -> Batch:
        mb = take(b, i * per, (i + 1) * per, rows)
        if self._widths is None:
            return mb
        w = self._widths[i]  # padded to its own longest sample
        return Batch(args=(mb.args[0][:, :w],), targets=mb.targets[:, :w])

    def loss(self, module: nn.Module, b: Batch) -> torch.Tensor:
        return loss_fn(module(*b.args), b.targets)  # tp > 1: on vocabulary-sharded logits (loss_parallel)

    def pp_inputs(self, par: Parallelized, b: Batch) -> tuple:
        return b.args

    def pp_target(self, b: Batch) -> torch.Tensor:
        return b.targets

    def logical(self, part: nn.Module, name: str, value: Any) -> tuple[str | None, Any]:
        if name == "output.weight" and part.embed is not None and part.output is not None \
                and part.output.weight is part.embed.tok.weight:  # pp = 1 tied: the alias of embed.tok.weight
            return None, value
        return logical_name(part, name), value


def train_model(cfg: RunConfig) -> TrainModel:
    """The TrainModel of ``cfg``'s model."""
    if cfg.ingested:
        return IngestedModel(cfg)
    return PresetModel(cfg)


class Trainer:
    """Model, optimizer and data of one rank (or of the single-process reference)."""

    def __init__(self, cfg: RunConfig, mesh: RuntimeMesh | None, device: torch.device) -> None:
        self.cfg, self.mesh, self.device = cfg, mesh, device
        plan = cfg.plan
        self.dp_rank = mesh.dp_rank if mesh is not None else 0
        if plan.dp_shares is not None:
            hetero.check_shares(plan, cfg.global_batch)
        hetero.check_buckets(plan, cfg.lengths, ingested=cfg.ingested)
        if not cfg.ingested:
            hetero.check_lengths(plan, cfg.lengths)
        self.bucketed = bool(plan.buckets)
        """A bucket plan: each rank runs its own list of micro-batches (``_bucket_forward_backward``)."""
        self.n_micro = rank_microbatches(cfg, self.dp_rank)
        self.rows = self.n_micro * plan.micro_batch
        """Samples of the global batch this replica trains on per step."""
        self.uneven = hetero.uneven(plan, cfg.global_batch)
        """Uneven dp_shares: the replicas run different numbers of micro-batches."""
        self.model: TrainModel = train_model(cfg)
        self.weighted = self.uneven or self.model.varied
        """Micro-batch losses weighted by ``_mb_weight`` (not averaged over micro-batches)."""
        self.par: Parallelized = self.model.parallelize(plan, mesh, device, self.n_micro)
        if self.weighted and self.par.schedule is not None:
            self._weight_schedule()
        if self.uneven and self.par.dp_mode == "fsdp" and plan.pp == 1 and plan.zero >= 2:
            self.par.gather_during_step = True  # the same collectives on replicas of different micro-batch counts
            self.par.notes.append(f"zero={plan.zero} with uneven dp_shares: the replicas run different numbers of "
                                  "micro-batches, so FSDP keeps the parameters gathered and the gradients unsharded "
                                  "from the first micro-batch to the last (one all-gather and one reduce-scatter a "
                                  f"step, as zero=1); zero={plan.zero}'s sharding holds between steps")
        self._closing = self.bucketed and self.par.dp_mode in ("ddp", "fsdp")
        """Bucket plans under DDP / FSDP: the step ends with a pass weighted 0 that carries the gradient sync."""
        if self._closing:
            self._bucket_sync_setup()
        self.optimizers = [make_optimizer(cfg, p.parameters()) for p in self.par.parts]
        ep = mesh is not None and mesh.ep > 1
        self._params = [(p, ep and is_expert_param(name)) for part in self.par.parts
                        for name, p in part.named_parameters()]
        """(parameter, is an expert-parallel expert's), listed once: the step loops over this."""
        self.compression = compression_of(cfg.plan) if self.par.dp_mode == "manual" else None
        """The manual all-reduce's gradient compression (DDP has it as its hook, FSDP2 as reduce_dtype)."""
        self.outer: OuterSync | None = None
        """local-sgd/diloco: the outer sync across inner groups (runtime/periodic.py)."""
        if cfg.plan.periodic and mesh is not None and mesh.workers > 1:
            self.outer = OuterSync(cfg.plan, [p for p, _ in self._params], mesh.outer_group, device,
                                   lr=cfg.outer_lr, momentum=cfg.outer_momentum)
        self._clip_groups: list[tuple[bool, Any, list[torch.Tensor]]] | None = None
        self._grads_final = False
        """True once a step showed that gradients need no finishing (placements do not change)."""
        self.step = 0  # optimizer steps done; also the data position
        self.grad_norm: torch.Tensor | None = None
        """Global gradient norm of the last step (before clipping), left on the device."""

    def _bucket_sync_setup(self) -> None:
        """FSDP keeps the parameters gathered through the step (as with uneven dp_shares), and the
        note that says how a bucket plan's gradients are synchronised."""
        plan = self.cfg.plan
        how = "DDP's all-reduce"
        if self.par.dp_mode == "fsdp":
            self.par.gather_during_step = True  # the same collectives on ranks of different micro-batch counts
            how = "FSDP's reduce-scatter" + (f" (zero={plan.zero}: parameters kept gathered and gradients unsharded "
                                             "through the step, one all-gather and one reduce-scatter, as zero=1; "
                                             f"zero={plan.zero}'s sharding holds between steps)" if plan.zero >= 2
                                             else "")
        from meshplan.spec.buckets import buckets_text
        self.par.notes.append(f"buckets={buckets_text(plan.bucket_specs)}: ranks run different numbers of "
                              "micro-batches, so each runs without gradient sync and every step ends with a one-token "
                              f"pass whose loss is multiplied by 0 on every rank, whose backward carries {how}")

    @property
    def sample_tokens(self) -> int:
        return self.model.sample_tokens

    @property
    def tokens_per_step(self) -> int:
        """Tokens of the last step (variable lengths: its real tokens; else global batch x sample tokens)."""
        if self.model.varied and self.model.step_tokens is not None:
            return self.model.step_tokens
        return self.cfg.global_batch * self.model.sample_tokens

    def _mb_weight(self, targets: Any) -> Any:
        """The weight of a micro-batch's loss (a mean over its rows or real tokens) such that the
        data-parallel average (over dp x cp) of the summed weighted losses is the mean over the
        global batch: variable lengths, dp x cp x its real tokens / the global batch's real tokens;
        uneven dp_shares, dp x micro_batch / global batch (for every replica alike)."""
        ndp = self.mesh.ndp if self.mesh is not None else 1
        if self.model.varied:
            assert self.model.step_tokens
            real = (targets != hetero.IGNORE).sum()
            return real.to(torch.float32) * (ndp / self.model.step_tokens)
        dp = self.mesh.dp if self.mesh is not None else 1
        return dp * self.cfg.plan.micro_batch / self.cfg.global_batch

    def _weight_schedule(self) -> None:
        """A pipeline schedule of weighted micro-batches: its loss function times ``_mb_weight`` of
        the micro-batch's targets, gradients summed over micro-batches (``scale_grads`` off)."""
        sched = self.par.schedule
        if not hasattr(sched, "_loss_fn") or not hasattr(sched, "scale_grads"):
            raise RuntimeError("torch.distributed.pipelining: this torch's schedules have no _loss_fn/scale_grads")
        base = sched._loss_fn

        def weighted(output: Any, target: Any) -> torch.Tensor:
            weight = self._mb_weight(target)
            if self.model.varied and not bool((target != hetero.IGNORE).any()):
                # a cp shard of short samples padded to the longest length may hold no real target
                # token: one token 0 gives a finite loss (not the mean over nothing), weighted 0
                target = target.clone()
                target.view(-1)[0] = 0
            return base(output, target) * weight
        sched._loss_fn = weighted
        sched.scale_grads = False

    # ---- one step ------------------------------------------------------------------------------
    def _autocast(self) -> Any:
        dt = self.par.autocast
        return torch.autocast(self.device.type, dtype=dt) if dt is not None else contextlib.nullcontext()

    def _forward_backward(self, b: Batch) -> torch.Tensor:
        """Local loss (mean over this rank's rows; 0 on pipeline ranks without the last stage)."""
        if self.par.schedule is not None:
            losses: list[torch.Tensor] = []
            kwargs: dict[str, Any] = {}
            if self.par.has_last:
                kwargs = {"target": self.model.pp_target(b), "losses": losses}
            args = self.model.pp_inputs(self.par, b) if self.par.has_first else ()
            with self._autocast(), self.par.loss_context():  # the last stage's loss and its backward
                self.par.schedule.step(*args, **kwargs)
            if not losses:
                return torch.zeros((), device=self.device)
            stacked = torch.stack(losses).detach()  # weighted: already scaled per micro-batch
            return stacked.sum() if self.weighted else stacked.mean()
        module = self.par.run_modules[0]
        total = torch.zeros((), device=self.device)
        rows, per = self.rows, self.cfg.plan.micro_batch
        for i in range(self.n_micro):
            mb = self.model.micro(b, i, per, rows)
            # DDP: no_sync but on the last; FSDP: the ZeRO level's gather/reduce flags (parallelize.py)
            with self.par.micro_batch(last=i == self.n_micro - 1), self.par.loss_context():
                with self._autocast():  # tp > 1: the loss on vocabulary-sharded logits (loss_parallel)
                    loss = self.model.loss(module, mb)
                    loss = loss * self._mb_weight(mb.targets) if self.weighted else loss / self.n_micro
                loss.backward()
            total += loss.detach()
        return total

    def _bucket_forward_backward(self) -> torch.Tensor:
        """A bucket plan's step on this rank: its micro-batches (``PresetModel.bucket_runs``) in
        order, each with its cp degree (``Parallelized.sequence``) and weighted by its real tokens
        (``_mb_weight``), all without gradient sync (DDP ``no_sync``; FSDP accumulating with the
        parameters gathered); then, under DDP / FSDP, the closing pass: one token, its loss times 0
        (its gradient adds exactly 0), gradient sync on, so that every rank issues the data-parallel
        reduction once, at the same point, whatever its micro-batch count. Returns the local loss."""
        model = self.model
        assert isinstance(model, PresetModel)
        module = self.par.run_modules[0]
        total = torch.zeros((), device=self.device)
        for run in model.bucket_runs(self.step, self.mesh, self.device):
            with self.par.micro_batch(last=False), self.par.sequence(run.cp, run.index, run.width, self.device), \
                    self.par.loss_context():
                with self._autocast():
                    loss = model.loss(module, run.batch)
                    weight = self._mb_weight(run.batch.targets) if run.real else 0.0
                    loss = loss * weight
                loss.backward()
            total += loss.detach()
        if self._closing:
            with self.par.micro_batch(last=True), self.par.sequence(1, 0, 1, self.device), self.par.loss_context():
                with self._autocast():
                    loss = model.loss(module, model.closing_batch(self.device)) * 0.0
                loss.backward()
        return total

    def _finish_grads(self) -> None:
        """Gradients as the optimizer needs them: averaged over dp x cp (manual mode), experts'
        FSDP average over their replicas divided by ep, sums left Partial by sequence-parallel
        norms reduced once here (not in every AdamW op, nor wrongly in the norm)."""
        if self.par.dp_mode == "manual":
            self._manual_dp_sync()
        if not self._grads_final:
            self._finish_placements()
        self.par.sync_tied()  # tied embeddings under a pipeline: both copies get the summed gradient
    def _finish_placements(self) -> None:
        """Partial sums reduced, experts divided by ep (see ``_finish_grads``)."""
        fsdp = self.par.dp_mode == "fsdp"
        experts: list[torch.Tensor] = []
        partial = False
        for p, expert in self._params:
            g = p.grad
            if g is None:
                continue
            if _is_dtensor(g):
                if any(pl.is_partial() for pl in g.placements):
                    partial = True
                    from torch.distributed.tensor import Replicate
                    p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl
                                                            for pl in g.placements])
                if expert and fsdp:
                    experts.append(g.to_local())
            elif expert and fsdp:
                experts.append(g)
        if experts:
            torch._foreach_div_(experts, float(self.mesh.ep))  # type: ignore[union-attr]
        self._grads_final = not (partial or experts)  # nothing to do now: nor in later steps

    def _manual_dp_sync(self) -> None:
        """DDP by hand: one flattened all-reduce of this rank's local gradients over dp x cp, then
        average. Expert-parallel experts are all-reduced over their replicas only (their gradient
        already sums the ep group's tokens) and averaged over dp x cp like the rest. A parameter
        without a gradient here (an expert no token of this rank reached) takes part with zeros;
        one with a gradient on no rank keeps none (as in one process: AdamW skips it): a flag per
        parameter rides along in the same all-reduce."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        mesh = self.mesh
        assert mesh is not None
        buckets: dict[bool, list[torch.Tensor]] = {False: [], True: []}
        for p, expert in self._params:
            buckets[expert].append(p)
        for expert, params in buckets.items():
            if not params:
                continue
            had = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=self.device)
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad.to_local() if _is_dtensor(p.grad) else p.grad for p in params]
            group = mesh.expert_dp.get_group() if expert else mesh.sync_group  # type: ignore[union-attr]
            if self.compression is not None:  # the flags alone; the gradients through the DDP hook's arithmetic
                anywhere = had.clone()
                dist.all_reduce(anywhere, group=group)
                self.compression.mean(grads, group, key=expert)  # the mean over the group
                if expert:  # averaged over dp x cp like the rest (see above)
                    torch._foreach_mul_(grads, dist.get_world_size(group) / mesh.sync_ndp)
            else:
                flat = _flatten_dense_tensors([*grads, had.to(grads[0].dtype)])
                dist.all_reduce(flat, group=group)
                flat /= mesh.sync_ndp
                *out, anywhere = _unflatten_dense_tensors(flat, [*grads, had])
                for g, r in zip(grads, out):
                    g.copy_(r)
            for p, n in zip(params, anywhere.tolist()):
                if n == 0:
                    p.grad = None

    def _clip(self) -> torch.Tensor:
        """Global gradient norm over all stages, meshes and experts, then clip_grads_with_norm_
        (clip_grad_norm_ fails when parameters live on different meshes, as in PP x TP x FSDP).
        Per group of gradients with the same mesh and placements: the local sum of squares,
        summed over the mesh dims they are sharded on (this is what DTensor's full_tensor does,
        also for gradients FSDP offloads to host memory); experts summed over the ep group;
        stages summed over pipeline ranks. The last stage's copy of tied embeddings is left out of
        the norm (its gradient equals the first stage's after ``sync_tied``: the single-process
        model counts the one tensor once) but clipped like the rest. The grouping is worked out
        once."""
        mesh = self.mesh
        copies = {id(p) for p in self.par.tied_copies}
        params = [p for p, _ in self._params if p.grad is not None and id(p) not in copies]
        if self._clip_groups is None or sum(len(g[2]) for g in self._clip_groups) != len(params):
            by_key: dict[tuple[bool, Any], list[torch.Tensor]] = {}
            for p, expert in self._params:
                g = p.grad
                if g is not None and id(p) not in copies:
                    by_key.setdefault((expert, (g.device_mesh, g.placements) if _is_dtensor(g) else None), []).append(p)
            self._clip_groups = [(expert, key, ps) for (expert, key), ps in by_key.items()]
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        local: list[torch.Tensor] = []  # every gradient's local tensor: clipped without DTensor dispatch
        local += [p.grad.to_local() if _is_dtensor(p.grad) else p.grad for p in self.par.tied_copies
                  if p.grad is not None]
        for expert, key, ps in self._clip_groups:
            grads = [p.grad.to_local() if key is not None else p.grad for p in ps]
            local += grads
            sq = torch.nn.utils.get_total_norm(grads, foreach=False).to(self.device, torch.float32) ** 2
            if key is not None:
                dmesh, placements = key
                for dim, pl in enumerate(placements):
                    if not pl.is_replicate():  # Shard or _StridedShard (Partial is gone: _finish_grads)
                        dist.all_reduce(sq, group=dmesh.get_group(dim))
            if expert:
                dist.all_reduce(sq, group=mesh.ep_group)  # type: ignore[union-attr]
            total += sq
        if mesh is not None and mesh.pp > 1:
            dist.all_reduce(total, group=mesh.pp_group)
        norm = total.sqrt()
        if self.cfg.grad_clip > 0:  # clip_grads_with_norm_'s arithmetic, on the local tensors
            coef = torch.clamp(self.cfg.grad_clip / (norm + 1e-6), max=1.0)
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for g in local:
                by_device.setdefault(g.device, []).append(g)
            for dev, gs in by_device.items():
                torch._foreach_mul_(gs, coef.to(dev))
        return norm

    def _global_loss(self, local: torch.Tensor) -> float:
        return self.reduce_metrics(local)[0]

    def reduce_metrics(self, local: torch.Tensor, *maxima: float) -> list[float]:
        """[global loss, *max over ranks of each of ``maxima``] in one collective (an all-gather
        of a few numbers per rank): the loss is the mean over dp x cp of the local losses of
        tp rank 0 (pipeline ranks without the last stage hold 0)."""
        if self.mesh is None or not dist.is_initialized():
            return [float(local), *maxima]
        mesh = self.mesh
        contrib = local.detach().float() / mesh.ndp if mesh.tp_rank == 0 else torch.zeros((), device=self.device)
        mine = torch.stack([contrib.to(torch.float64), *(torch.tensor(m, dtype=torch.float64, device=self.device)
                                                         for m in maxima)])
        every = torch.empty(dist.get_world_size() * mine.numel(), dtype=torch.float64, device=self.device)
        dist.all_gather_single(every, mine)  # flat: gloo wants the output 1-D
        every = every.view(-1, mine.numel())
        out = [float(every[:, 0].sum())]
        if maxima:
            out += every[:, 1:].amax(dim=0).tolist()
        return out

    def step_local(self) -> torch.Tensor:
        """One optimizer step on global batch number ``self.step``; returns this rank's loss
        (a tensor, not reduced: ``reduce_metrics`` makes it global)."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        if self.bucketed:
            local = self._bucket_forward_backward()
        else:
            local = self._forward_backward(self.model.rank_batch(self.step, self.mesh, self.device))
        self._finish_grads()
        self.grad_norm = self._clip()
        for opt in self.optimizers:
            opt.step()
        self.step += 1
        if self.outer is not None:  # the outer sync when due; an overlapped one applied after its tau steps
            self.outer.after_step(self.step)
        return local

    def train_step(self) -> float:
        """One optimizer step on global batch number ``self.step``; returns the global loss."""
        return self._global_loss(self.step_local())

    # ---- inspection ----------------------------------------------------------------------------
    def full_weights(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters this rank's stages hold, by their names in the single-process model
        (collective over dp/tp, and over ep for fused experts held in part: ``expert_rows``): a tied
        output copy as ``embed.tok.weight``, padded vocabulary rows cut off."""
        out: dict[str, torch.Tensor] = {}
        vocab = self.model.vocab_rows
        for part in self.par.parts:
            for name, p in part.named_parameters():
                t = p.full_tensor() if _is_dtensor(p) else p
                if clean_fqn(name) in self.model.expert_rows:
                    assert self.mesh is not None
                    pieces = [torch.empty_like(t) for _ in range(self.mesh.ep)]
                    dist.all_gather(pieces, t.detach().contiguous(), group=self.mesh.ep_group)
                    t = torch.cat(pieces)
                key, t = self.model.logical(part, clean_fqn(name), t)
                if key is None:
                    continue
                if vocab is not None and key in VOCAB_PARAMS:
                    t = t[:vocab]
                out[key] = t.detach().float().cpu().clone()
        return out


def make_optimizer(cfg: RunConfig, params: Any) -> torch.optim.Optimizer:
    """The run's (inner) optimizer over ``params``: AdamW (``ADAMW``), SGD (``SGD``) or Adafactor
    (``ADAFACTOR``); the others the planner prices (lion, adam8bit) are refused before launch
    (cli.train_cmd), and here too."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, **SGD)
    if cfg.optimizer == "adafactor":
        return torch.optim.Adafactor(params, lr=cfg.lr, **ADAFACTOR)
    if cfg.optimizer != "adamw":
        raise MeshplanError(f"optimizer {cfg.optimizer!r}: meshplan's runtime runs {', '.join(OPTIMIZERS)} only",
                            hint="plan and export it, or train with --optimizer adamw, sgd or adafactor")
    return torch.optim.AdamW(params, lr=cfg.lr, **ADAMW)


def reference_run(cfg: RunConfig, steps: int, micro_batch: int | None = None,
                  ) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """The single-process run of ``cfg`` on the whole global batch (in micro-batches of
    ``micro_batch`` rows: a model with batch statistics, BatchNorm, must see the distributed run's
    micro-batches; default one): losses, gradient norms (which, unlike Adam's updates, show a
    wrongly scaled gradient) and final weights."""
    ref_plan = Plan(micro_batch=micro_batch or cfg.global_batch, precision=cfg.plan.precision)
    t = Trainer(RunConfig(**{**cfg.__dict__, "plan": ref_plan}), None, torch.device("cpu"))
    losses, norms = [], []
    for _ in range(steps):
        losses.append(t.train_step())
        norms.append(float(t.grad_norm))  # type: ignore[arg-type]
    return losses, norms, t.full_weights()


# ---- measurement -------------------------------------------------------------------------------
def peak_memory_gib(device: torch.device) -> float:
    """CUDA: max_memory_allocated; CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 2**20


@typing.overload
def max_over_ranks(value: float, device: torch.device) -> float: ...
@typing.overload
def max_over_ranks(value: list[float], device: torch.device) -> list[float]: ...
def max_over_ranks(value: float | list[float], device: torch.device) -> float | list[float]:
    """The maximum over all ranks (one all-reduce for a list of values)."""
    values = value if isinstance(value, list) else [value]
    if dist.is_initialized():
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        values = t.tolist()
    return values if isinstance(value, list) else values[0]


@dataclass
class StepRecord:
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    peak_memory_gib: float
    wall_time: float = 0.0
    """time.time() at the end of the step on this rank (intervals include everything the loop does)."""
    cpu_time: float = 0.0
    """time.process_time() of this rank's process at the end of the step (intervals: CPU seconds
    per step, less sensitive than wall time to other load on a shared machine)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "loss": self.loss, "step_time_s": self.step_time_s,
                "tokens_per_s": self.tokens_per_s, "peak_memory_gib": self.peak_memory_gib,
                "wall_time": self.wall_time, "cpu_time": self.cpu_time, **self.extra}


def timed_step(trainer: Trainer) -> StepRecord:
    """One step, timed on every rank; the loss, the slowest rank's time and the largest peak
    memory are then gathered in one collective (the only one the loop adds to training's)."""
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    t0 = time.perf_counter()
    local = trainer.step_local()
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    loss, dt, mem = trainer.reduce_metrics(local, time.perf_counter() - t0, peak_memory_gib(trainer.device))
    toks = trainer.tokens_per_step
    extra = {"real_tokens": toks} if trainer.model.varied else {}
    return StepRecord(step=trainer.step, loss=loss, step_time_s=dt, tokens_per_s=toks / dt, peak_memory_gib=mem,
                      wall_time=time.time(), cpu_time=time.process_time(), extra=extra)


def maybe_fail(step: int) -> None:
    """Test hook: MESHPLAN_FAIL_AT=RANK:STEP kills RANK once STEP steps are done, on the first attempt only
    (exit code 17; RANK:STEP:SIGKILL: that signal, as the kernel's OOM killer would)."""
    spec = os.environ.get(FAIL_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank, at, *how = spec.split(":")
    if dist.is_initialized() and dist.get_rank() == int(rank) and step == int(at):
        print(f"meshplan: fault injection: rank {rank} exits after {step} steps", file=sys.stderr, flush=True)
        if how:
            import signal
            os.kill(os.getpid(), getattr(signal, how[0]))
        os._exit(17)


def site_rank(env: Any) -> int | None:
    """Under ``meshplan train --site`` (the launcher sets MESHPLAN_NODE_RANK): this rank's global rank is
    node rank x LOCAL_WORLD_SIZE + LOCAL_RANK, written into RANK (and GROUP_RANK) before the process group
    is made, so that site site_order[k]'s nodes hold the k-th block of ranks whatever order torchrun's
    c10d rendezvous gave the nodes (it numbers them by host and pid and ignores --node-rank). The
    workers connect to torchrun's agent store as clients, so any rank may sit on any node. None: no
    remap (RANK as torchrun set it)."""
    node = env.get("MESHPLAN_NODE_RANK")
    if node is None:
        return None
    if str(env.get("TORCHELASTIC_USE_AGENT_STORE", "")).lower() != "true":
        from meshplan.errors import MeshplanError
        raise MeshplanError("--site: the ranks are numbered by site only under torchrun's agent store "
                            "(TORCHELASTIC_USE_AGENT_STORE); this torchrun does not provide it",
                            hint="start the nodes with --node-rank in site_order (docs/runtime.md, Placement)")
    rank = int(node) * int(env["LOCAL_WORLD_SIZE"]) + int(env.get("LOCAL_RANK", "0"))
    env["RANK"], env["GROUP_RANK"] = str(rank), str(node)
    return rank


def claim_rank(store: Any, rank: int, world: int, per_node: int, who: str, timeout_s: float, prefix: str) -> None:
    """Before the process group is made on several nodes: every process claims its global rank in the
    rendezvous store, so that two nodes given one node rank (the same ``--site``/``--site-node``, or flags that
    map two nodes to one rank) fail at once in one line, instead of waiting for the ranks nobody holds until
    the process group times out. Every process adds 1 to its rank's count and says who it is; once all
    ``world`` have claimed, each checks its own rank's count and records a duplicate before it counts itself
    checked; once all are checked, every process raises the same MeshplanError if any rank was claimed twice.
    O(1) store operations per process (the error path reads every node's first rank). A process that never
    claims (a node started without these checks) leaves the others waiting ``timeout_s``, then a one-line error."""
    import datetime

    from meshplan.errors import MeshplanError
    wait = datetime.timedelta(seconds=timeout_s)
    n = store.add(f"{prefix}/rank/{rank}", 1)
    store.set(f"{prefix}/who/{rank}/{n}", who)
    if store.add(f"{prefix}/claimed", 1) == world:
        store.set(f"{prefix}/all", "1")
    try:
        store.wait([f"{prefix}/all"], wait)
    except Exception as e:  # noqa: BLE001 - torch raises its own store timeout types
        got = store.add(f"{prefix}/claimed", 0)
        raise MeshplanError(f"rank {rank}: only {got} of the {world} processes reached the ranks' check within "
                            f"{timeout_s:g} s: some node did not start, or runs another meshplan train (every node "
                            "needs the same plan, --nnodes and, with site_order, --site)",
                            hint="start every node with the same command but its own --site / --site-node") from e
    if store.add(f"{prefix}/rank/{rank}", 0) > 1:
        store.set(f"{prefix}/dup", str(rank))
    if store.add(f"{prefix}/checked", 1) == world:
        store.set(f"{prefix}/done", "1")
    store.wait([f"{prefix}/done"], wait)
    if not store.check([f"{prefix}/dup"]):
        return
    dup = int(store.get(f"{prefix}/dup"))
    node = dup // per_node
    holders = [store.get(f"{prefix}/who/{dup}/{k}").decode() for k in (1, 2)]
    empty = [k for k in range(world // per_node) if not store.check([f"{prefix}/rank/{k * per_node}"])
             or store.add(f"{prefix}/rank/{k * per_node}", 0) == 0]
    raise MeshplanError(f"two nodes took node rank {node} ({holders[0]}; {holders[1]}), so they hold the same ranks"
                        + (f" and node rank{'s' * (len(empty) > 1)} {', '.join(map(str, empty))} none" if empty else "")
                        + ": the run would wait for the missing ranks until the process group times out",
                        hint="give each node its own --site / --site-node; each launcher prints the node rank its "
                             "flags map to")


def _claim(env: Any, timeout_s: float) -> None:
    """train.claim_rank for a run of several nodes under torchrun's agent store (no-op otherwise)."""
    if int(env.get("GROUP_WORLD_SIZE", "1")) < 2 or str(env.get("TORCHELASTIC_USE_AGENT_STORE", "")).lower() != "true":
        return
    import datetime
    import socket
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    flags = env.get("MESHPLAN_NODE_FLAGS") or f"node rank {env.get('GROUP_RANK', '?')}"
    who = f"{socket.gethostname()} pid {os.getpid()}, {flags}"
    claim_rank(store, rank, world, int(env.get("LOCAL_WORLD_SIZE", "1")), who, timeout_s,
               f"meshplan-ranks-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")


def init_distributed(timeout_s: float) -> torch.device:
    """Join the torchrun job: NCCL on GPUs, gloo on CPU, with a process-group timeout."""
    import datetime
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if dist.is_initialized():
        return device
    site_rank(os.environ)
    _claim(os.environ, timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0":
        dist.init_process_group(backend=backend, timeout=timeout)
        return device
    # After a torchrun restart the rendezvous store still holds the dead attempt's gloo addresses
    # (ranks would connect to closed ports): give this attempt its own key prefix.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=not agent and rank == 0, timeout=timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"meshplan-attempt-{attempt}", base),
                            rank=rank, world_size=world, timeout=timeout)
    return device
