"""Heterogeneous hardware and data in the runtime (no torch here; numpy only).

- **Uneven data-parallel shares** (``Plan.dp_shares``): replica r trains on
  ``global_batch * share_r / sum(shares)`` consecutive samples of the step (the same samples as an
  even run, in the same order: only the cut between replicas moves), as whole micro-batches of
  ``micro_batch`` samples (``replica_rows``: refused in one line otherwise). Every micro-batch's
  loss is weighted by ``dp * micro_batch / global_batch`` (not 1 / the replica's own micro-batch
  count), so that the data-parallel average (which divides by dp) gives the mean over the whole
  global batch (train.Trainer).
- **Pools** (``Plan.pools`` with ``pool_dp`` / ``pool_pp``): placement only. ``pool_ranks`` says
  which ranks stand for which pool (pool_pp: the first pool's pipeline stages first; pool_dp: the
  first pool's replicas first); every rank runs on this machine's hardware at its speed.
- **Variable-length samples** (``spec.lengths.LengthDist``): ``step_layout`` draws the step's
  sample lengths from the seed and forms micro-batches exactly as spec/lengths.py defines padded
  and bucketed packing; packed windows are made by ``data.packed_batch``.
- **Bucket plans** (``Plan.buckets``, spec/buckets.py): ``bucket_step`` forms the step's
  micro-batches (a micro-batch size and a cp degree per length bucket) and deals them to units of
  ranks with ``spec.buckets.bucket_layout``, from the same lengths; ``check_buckets`` says what
  the runtime refuses of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from meshplan.errors import MeshplanError
from meshplan.spec.axes import AX
from meshplan.spec.lengths import LengthDist
from meshplan.spec.plan import Plan, share_split, share_unit, split_fault
from meshplan.units import ranges_text

IGNORE = -100
"""Target id of padding: cross-entropy's default ignore_index (its loss and gradient are 0)."""
LENGTH_SEED = 0x5EC1E7
"""Mixed into the seed of the sample lengths (numpy's generator; the tokens use torch's)."""


# ---- uneven shares -----------------------------------------------------------------------------
def _shares_text(plan: Plan) -> str:
    return ":".join(str(s) for s in plan.dp_shares or ())


def replica_rows(plan: Plan, global_batch: int) -> tuple[int, ...]:
    """Samples of the global batch per data-parallel replica: ``global_batch * share / sum(shares)``
    (even shares: global_batch / dp). A one-line MeshplanError when a replica's share is not a
    whole, non-zero number of micro-batches."""
    shares = plan.replica_shares
    total = sum(shares)
    m = plan.micro_batch
    out = []
    for r, (s, (rows, rem)) in enumerate(zip(shares, share_split(shares, global_batch))):
        what = split_fault(rows, rem, m)
        if what is not None:
            unit = share_unit(shares, m)
            got = f"{global_batch * s / total:.4g}"
            if plan.dp_shares is None:
                raise MeshplanError(f"--global-batch {global_batch} is not divisible by dp x micro_batch = "
                                    f"{plan.dp} x {m}", hint="change the batch or the plan")
            raise MeshplanError(
                f"dp_shares={_shares_text(plan)}: replica {r}'s share of --global-batch {global_batch} is {got} "
                f"samples ({s}/{total} of it): {what}",
                hint=f"use a --global-batch that is a multiple of {unit} (sum of the replicas' shares x "
                     f"micro_batch), or change dp_shares or micro_batch")
        out.append(rows)
    return tuple(out)


def replica_microbatches(plan: Plan, global_batch: int) -> tuple[int, ...]:
    """Micro-batches per step of each data-parallel replica."""
    return tuple(r // plan.micro_batch for r in replica_rows(plan, global_batch))


def uneven(plan: Plan, global_batch: int) -> bool:
    """The replicas run different numbers of micro-batches (dp_shares not all equal)."""
    return plan.dp_shares is not None and len(set(plan.replica_shares)) > 1 \
        and len(set(replica_rows(plan, global_batch))) > 1


def replica_span(plan: Plan, global_batch: int, dp_rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of the global batch that replica ``dp_rank`` trains on (consecutive blocks in
    replica order: the even run's samples, cut at other places)."""
    rows = replica_rows(plan, global_batch)
    lo = sum(rows[:dp_rank])
    return lo, lo + rows[dp_rank]


def check_shares(plan: Plan, global_batch: int, *, periodic_ok: bool = False) -> None:
    """What the runtime refuses with uneven shares, in one line: shares that do not cut the batch
    into whole micro-batches, expert parallelism (its all-to-alls pair micro-batches across
    replicas), local SGD / DiLoCo (each worker's own step: there is no global batch to weight),
    and pipeline schedules that need more micro-batches per replica than a replica has."""
    counts = replica_microbatches(plan, global_batch)
    if plan.dp_shares is None or len(set(counts)) == 1:
        return
    shares = _shares_text(plan)
    if plan.ep > 1:
        raise MeshplanError(f"dp_shares={shares} with ep={plan.ep}: expert parallelism exchanges tokens between "
                            "replicas every micro-batch, which needs the same micro-batch count on each",
                            hint="drop dp_shares or use ep=1")
    if plan.periodic and not periodic_ok:
        raise MeshplanError(f"dp_shares={shares} with grad_sync={plan.grad_sync}: each worker steps on its own "
                            "batch, so there is no global-batch gradient to weight the shares into",
                            hint="drop dp_shares, or use a synchronous grad_sync")
    if plan.pp > 1 and plan.schedule in ("interleaved-1f1b", "zero-bubble", "zbv"):
        few = [f"replica {r}: {n}" for r, n in enumerate(counts) if n < plan.pp
               or (plan.schedule == "interleaved-1f1b" and plan.virtual_stages > 1 and n % plan.pp)]
        if few:
            raise MeshplanError(f"dp_shares={shares} with schedule={plan.schedule}: every replica needs at least "
                                f"pp={plan.pp} micro-batches per step (a multiple of pp for interleaved 1F1B), got "
                                + ", ".join(few[:4]), hint="raise --global-batch, lower micro_batch, or use 1f1b")


def shares_note(plan: Plan, global_batch: int, varied: bool = False) -> str | None:
    """What rank 0 says about uneven shares (None: even); ``varied``: samples of several lengths
    (their micro-batches are weighted by real tokens instead)."""
    if plan.dp_shares is None:
        return None
    rows = replica_rows(plan, global_batch)
    if len(set(rows)) == 1:
        return None
    m = plan.micro_batch
    parts = ", ".join(f"{r}: {n} ({n // m} micro-batch{'es' if n // m != 1 else ''})" for r, n in enumerate(rows[:8]))
    more = f", ... ({len(rows)} replicas)" if len(rows) > 8 else ""
    weight = ("by dp x its real tokens / the global batch's real tokens" if varied else
              f"by dp x micro_batch / global batch = {plan.dp * m}/{global_batch}")
    return (f"dp_shares={_shares_text(plan)}: samples per replica {parts}{more}; each micro-batch's loss weighted "
            f"{weight}, so the gradient is the global batch's mean")


# ---- pools -------------------------------------------------------------------------------------
def pool_ranks(plan: Plan) -> list[tuple[str, str, list[int]]]:
    """(pool, what it holds, its global ranks) in pool order; [] without pools. pool_pp: pool i holds
    the next pool_pp[i] pipeline stages (the first pool's first); pool_dp: the next pool_dp[i]
    data-parallel replicas (the first pool's first)."""
    if not plan.pools:
        return []
    if len(plan.pools) > 1 and plan.pool_pp is None and plan.pool_dp is None:
        # device order: the ranks fill the pools' GPUs in turn (their sizes are the cluster's)
        return [(":".join(plan.pools), "device order (ranks fill each pool's GPUs in turn)",
                 list(range(plan.num_gpus)))]
    counts = plan.pool_pp or plan.pool_dp or (plan.pp,)
    axis = AX.DP if plan.pool_dp is not None else AX.PP
    dims = plan.dims  # global rank of a mesh coordinate: ParallelDims.rank (runtime/mesh.py's layout)
    out = []
    start = 0
    for name, k in zip(plan.pools, counts):
        idx = range(start, start + k)
        ranks = sorted(dims.rank(p, d, c, t)
                       for p in (idx if axis == AX.PP else range(plan.pp))
                       for d in (idx if axis == AX.DP else range(plan.dp))
                       for c in range(plan.cp) for t in range(plan.tp))
        noun = ("stage" if axis == AX.PP else "replica") + ("s" if k > 1 else "")
        what = f"{noun} {idx[0]}" if k == 1 else f"{noun} {idx[0]}-{idx[-1]}"
        out.append((name, what, ranks))
        start += k
    return out


def pools_note(plan: Plan, device_type: str = "cpu") -> str | None:
    """What rank 0 says about pools: which ranks emulate which pool, and that the pools' GPU types
    are emulated only by the cost model and the simulator."""
    placed = pool_ranks(plan)
    if not placed:
        return None
    where = "; ".join(f"{name}: rank{'s' if len(ranks) > 1 else ''} {ranges_text(ranks)} ({what})"
                      for name, what, ranks in placed)
    hw = "CPU ranks" if device_type == "cpu" else f"{device_type} devices"
    return (f"pools (placement only): {where}. All {hw} here run on the same hardware at the same speed: the pools' "
            "GPU types are emulated only by the cost model and the simulator (per-rank speed); the training math is "
            "the plan's without pools")


# ---- variable-length samples -------------------------------------------------------------------
@dataclass(frozen=True)
class StepLayout:
    """One step's samples as micro-batches (padded or bucketed packing; spec/lengths.py)."""

    lengths: np.ndarray
    """Tokens (inputs = targets) of each sample of the global batch, in data order."""
    replicas: tuple[tuple[tuple[int, ...], ...], ...]
    """Per data-parallel replica, its micro-batches in the order it runs them, each the indices
    of its samples (into ``lengths``)."""

    @property
    def total_tokens(self) -> int:
        """Real (not padding) target tokens of the whole global batch: the loss's denominator."""
        return int(self.lengths.sum())

    def padded_lengths(self, dp_rank: int) -> list[int]:
        """Each micro-batch's padded length (its longest sample) on replica ``dp_rank``."""
        return [int(self.lengths[list(mb)].max()) for mb in self.replicas[dp_rank]]


def sample_lengths(dist: LengthDist, global_batch: int, step: int, seed: int) -> np.ndarray:
    """The lengths of step ``step``'s samples: independent draws from ``dist``, a pure function of
    (seed, step) (numpy's PCG64 from a seed sequence: the same on every rank and machine)."""
    rng = np.random.default_rng([seed, step, LENGTH_SEED])
    return dist.sample(global_batch, rng)


def step_layout(dist: LengthDist, plan: Plan, global_batch: int, step: int, seed: int) -> StepLayout:
    """Micro-batches of one step (every rank computes all replicas' layout from the seed):

    - padded: samples in data order; replica r takes its block (``replica_span``), cut into
      micro-batches of micro_batch consecutive samples;
    - bucketed: the step's samples sorted by length (stable), cut into micro-batches of
      micro_batch in that order, micro-batch j to replica j mod dp; with uneven dp_shares,
      round-robin over the replicas that still have room for one (replica r gets its
      ``replica_microbatches`` count)."""
    lengths = sample_lengths(dist, global_batch, step, seed)
    m = plan.micro_batch
    rows = replica_rows(plan, global_batch)
    if dist.packing == "bucketed":
        order = np.argsort(lengths, kind="stable")
        mbs = [tuple(int(i) for i in order[j:j + m]) for j in range(0, global_batch, m)]
        quota = [n // m for n in rows]
        got: list[list[tuple[int, ...]]] = [[] for _ in rows]
        j = 0
        while j < len(mbs):
            for r in range(len(rows)):
                if j < len(mbs) and len(got[r]) < quota[r]:
                    got[r].append(mbs[j])
                    j += 1
        return StepLayout(lengths, tuple(tuple(g) for g in got))
    out = []
    lo = 0
    for n in rows:
        out.append(tuple(tuple(range(k, k + m)) for k in range(lo, lo + n, m)))
        lo += n
    return StepLayout(lengths, tuple(out))


def packed_documents(dist: LengthDist, tokens_needed: int, step: int, seed: int) -> np.ndarray:
    """Lengths of the documents concatenated into one step's packed windows: draws from ``dist``
    (from the seed) until they hold ``tokens_needed`` tokens (the last one is cut)."""
    rng = np.random.default_rng([seed, step, LENGTH_SEED, 1])
    out: list[np.ndarray] = []
    have = 0
    chunk = max(16, int(tokens_needed / dist.mean_len) + 16)
    while have < tokens_needed:
        more = dist.sample(chunk, rng)
        out.append(more)
        have += int(more.sum())
    docs = np.concatenate(out)
    keep = int(np.searchsorted(np.cumsum(docs), tokens_needed)) + 1
    return docs[:keep]


def check_batch(plan: Plan, global_batch: int) -> None:
    """The global batch against the plan: divisible by dp x micro_batch (even shares), or every
    replica's share a whole number of micro-batches (dp_shares; then ``check_shares``)."""
    if plan.dp_shares is None:
        from meshplan.spec.plan import checked_microbatches
        checked_microbatches(plan, global_batch)
        return
    check_shares(plan, global_batch)


def micro_counts(plan: Plan, global_batch: int) -> list[int]:
    """The distinct micro-batch counts of the replicas (one without dp_shares: the floor of
    global_batch / (dp x micro_batch), unchecked, as spec.plan.microbatches)."""
    if plan.dp_shares is None:
        from meshplan.spec.plan import microbatches
        return [microbatches(global_batch, plan.dp, plan.micro_batch)]
    return sorted(set(replica_microbatches(plan, global_batch)))


def check_lengths(plan: Plan, dist: LengthDist | None) -> None:
    """What the runtime refuses with samples of several lengths padded per micro-batch, in one line:
    context parallelism without a pipeline and without buckets (a micro-batch of its own width
    splits into 2 x cp chunks only under a bucket plan; under a pipeline every micro-batch is
    padded to the longest length, which splits as one length does) and local SGD / DiLoCo
    (the token weights are over the global batch, which their workers do not share every step).
    A bucket plan is checked by ``check_buckets`` instead (its cp is per micro-batch)."""
    if plan.buckets:
        check_buckets(plan, dist)
        return
    if dist is None or len(dist.lengths) < 2 or dist.packing == "packed":
        return
    if plan.cp > 1 and plan.pp == 1:
        mb = plan.micro_batch
        raise MeshplanError(f"--seq-len {dist.source or dist.text()} with cp={plan.cp} and no buckets: without a "
                            "pipeline each micro-batch is padded to its own longest sample, which context "
                            "parallelism splits only under a bucket plan (cp per micro-batch, each at its width)",
                            hint=f"add buckets={dist.max_len}x{mb}cp{plan.cp} (every sample over cp={plan.cp}; "
                                 "`meshplan plan` tries more), or use --packing packed, or cp=1")
    if plan.periodic:
        raise MeshplanError(f"--seq-len {dist.source or dist.text()} with grad_sync={plan.grad_sync}: variable-length "
                            "samples are weighted by the real tokens of the whole global batch, which local SGD / "
                            "DiLoCo workers do not share every step",
                            hint="use --packing packed, or a synchronous plan")


def lengths_note(plan: Plan, dist: LengthDist | None) -> str | None:
    """What the launcher says about variable-length samples (None: none)."""
    if dist is None:
        return None
    if plan.buckets and len(dist.lengths) > 1:
        from meshplan.spec.buckets import buckets_text, describe
        bs = plan.bucket_specs
        return (f"--seq-len {dist.text()} (mean {dist.mean_len:.1f} tokens), buckets={buckets_text(bs)}: "
                f"{describe(bs)}; every step's samples sorted by length, cut per bucket into "
                "micro-batches padded to their longest sample and dealt to units of ranks by load; the loss is the "
                "mean over the real tokens of the global batch")
    if len(dist.lengths) == 1:
        return (f"--seq-len {dist.source or dist.text()}: one length ({dist.max_len}); every sample has it, "
                f"--packing {dist.packing} changes nothing")
    what = {"padded": "each micro-batch padded to its longest sample",
            "bucketed": "the step's samples sorted by length, cut into micro-batches in that order, micro-batch j to "
                        "replica j mod dp (round-robin over the replicas with room, with dp_shares), each padded to "
                        "its longest sample",
            "packed": f"documents concatenated into windows of {dist.max_len} tokens (causal over the window)"}
    tail = ("; the loss is the mean over the real tokens of the global batch" if dist.packing != "packed" else "")
    pp = (f"; pp={plan.pp}: the pipeline needs one shape, so every micro-batch is padded to {dist.max_len}"
          if plan.pp > 1 and dist.packing != "packed" else "")
    return (f"--seq-len {dist.text()} (mean {dist.mean_len:.1f} tokens), --packing {dist.packing}: "
            f"{what[dist.packing]}{tail}{pp}")


def local_plan(plan: Plan) -> Plan:
    """The plan as priced on this machine's one device type: without pools (placement only here)."""
    if plan.pools is None:
        return plan
    return plan.replace(pools=None, pool_dp=None, pool_pp=None)


# ---- bucket plans ------------------------------------------------------------------------------
def bucket_step(dist: LengthDist, plan: Plan, global_batch: int, step: int, seed: int, knee: float) -> Any:
    """Step ``step``'s micro-batches under a bucket plan and who runs them (a
    ``spec.buckets.BucketLayout``): the lengths of ``sample_lengths`` (the same samples as any
    other plan's), formed and dealt by ``spec.buckets.bucket_layout``."""
    from meshplan.spec.buckets import bucket_layout
    lengths = sample_lengths(dist, global_batch, step, seed)
    return bucket_layout(lengths, plan.bucket_specs, plan.dp, plan.cp, knee)


def check_buckets(plan: Plan, dist: LengthDist | None, *, ingested: bool = False) -> None:
    """What the runtime refuses of a bucket plan, in one line: an ingested model (its batches have
    one shape), a workload without several unpacked lengths or with a sample longer than the last
    bucket (``spec.buckets.check_workload``), and local SGD / DiLoCo (the token weights are over the
    global batch). The plan's own rules (pp = 1, ep = 1, cp degrees) are Plan's."""
    if not plan.buckets:
        return
    from meshplan.spec.buckets import buckets_text, check_workload
    text = buckets_text(plan.bucket_specs)
    if ingested:
        raise MeshplanError(f"buckets={text} on an ingested model: bucket plans need samples of several lengths, "
                            "which only preset models have (an ingested model's batches have one shape)",
                            hint="drop buckets, or train a preset model with --seq-len L:p,...")
    if plan.periodic:
        raise MeshplanError(f"buckets={text} with grad_sync={plan.grad_sync}: the micro-batches are weighted by the "
                            "real tokens of the whole global batch, which local SGD / DiLoCo workers do not share "
                            "every step", hint="use a synchronous grad_sync, or drop buckets")
    varied = dist is not None and len(dist.lengths) > 1 and dist.packing != "packed"
    why = check_workload(plan.bucket_specs, dist.max_len if dist is not None else 0, varied)
    if why:
        raise MeshplanError(why, hint="or drop buckets" if not varied else
                            "or leave the longer lengths out of --seq-len")
