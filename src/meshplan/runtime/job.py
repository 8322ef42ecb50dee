"""What `meshplan train` was asked to do (``Job``) and the launcher's checks of it before anything starts
(``check_job``: the learning rate, output paths, --replan-after and --switch, the runtime's support,
positions, the planner's constraints, the checkpoint directory, memory; ``generic.preflight`` in place of
the preset checks for an ingested model). The launcher (launch.py) runs them before it starts torchrun,
--replan-after (replan.py) on every plan it would switch to.

No torch at import: the checks that need it (mesh, generic, checkpoint) import it when they run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError
from meshplan.runtime import hetero, preflight
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan

CALIBRATION_NAME = "replan-calibration.json"
"""The calibration's file name in --checkpoint-dir (without --metrics)."""


@dataclass(frozen=True, kw_only=True)
class Job:
    """Everything `meshplan train` was asked to do."""

    model: ModelSpec | str
    """A preset (ModelSpec) or an ingested model's source (``hf:config.json``, ``module:pkg.mod:factory``)."""
    plan: Plan
    global_batch: int
    seq_len: int | None
    """Presets: the run's (the model's by default); ingested models: None for ingestion's default."""
    steps: int
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    site_ranks: bool = False
    """The node rank was derived from --site (the plan's site_order): the ranks take their global rank
    from it (node rank x processes per node + local rank), not from torchrun's rendezvous order."""
    site_flags: str = ""
    """With site_ranks: this node's flags as given (``--site 1 --site-node 0``), for the messages that name
    two nodes given the same node rank (preflight.node_lock, train.claim_rank)."""
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    overwrite: bool = False
    """--overwrite: delete the checkpoint already in checkpoint_dir before launch (not with resume)."""
    metrics: str | None = None
    lr: float = 1e-3
    seed: int = 0
    data: str = "corpus"
    pg_timeout_s: float = 300.0
    model_arg: str = ""
    """--model as given (a preset name, a file, a source)."""
    plan_arg: str = ""
    extra_argv: list[str] = field(default_factory=list)
    replan_after: int | None = None
    """--replan-after N: after N steps of this launch, check the measurement against the cost model's
    band; outside it, fit a calibration and rank the plans again (runtime/replan.py). None: no check."""
    switch: bool = False
    """--switch: at that check, checkpoint and continue under a plan predicted better."""
    optimizer: str = "adamw"
    """--optimizer: the (inner) optimizer, one of spec.plan.RUNTIME_OPTIMIZERS (adamw, sgd, adafactor)."""
    grad_clip: float = 1.0
    """--grad-clip: the largest global gradient norm (0: no clipping)."""
    outer_lr: float | None = None
    """--outer-lr: DiLoCo's outer learning rate (None: periodic.OUTER_LR)."""
    outer_momentum: float | None = None
    """--outer-momentum: DiLoCo's outer Nesterov momentum (None: periodic.OUTER_MOMENTUM)."""
    nodes_per_dc: int | None = None
    """--nodes-per-dc: nodes per datacenter (sync_scope=dc needs it)."""
    lengths: Any = None
    """--seq-len L:p,... or a histogram file (presets): a spec.lengths.LengthDist with --packing
    (``seq_len`` is then its longest length); None: every sample is ``seq_len`` tokens."""

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def ingested(self) -> bool:
        return isinstance(self.model, str)

    def config(self) -> Any:
        """The RunConfig every rank trains."""
        from meshplan.runtime.run_config import RunConfig  # imports torch
        defaults = RunConfig(model=self.model, plan=self.plan, global_batch=self.global_batch, steps=self.steps)
        return RunConfig(model=self.model, plan=self.plan, global_batch=self.global_batch, seq_len=self.seq_len,
                         steps=self.steps, lr=self.lr, seed=self.seed, data=self.data, grad_clip=self.grad_clip,
                         optimizer=self.optimizer, lengths=self.lengths,
                         outer_lr=defaults.outer_lr if self.outer_lr is None else self.outer_lr,
                         outer_momentum=defaults.outer_momentum if self.outer_momentum is None
                         else self.outer_momentum)


def check_job(job: Job) -> Any:
    """Bad input, caught before anything starts: one-line MeshplanErrors. Ends with the memory
    pre-flight check (preflight.check_memory: the cost model's estimate against host memory on
    CPU, every process of the node counted, or against the GPU's memory); returns its estimate
    (None: not priced). Ingested models: ``generic.preflight`` in place of the preset checks."""
    return checked_job(job)[0]


def checked_job(job: Job) -> tuple[Any, Any]:
    """``check_job``; also the traced LayerGraph of an ingested model (None: a preset, or a model
    that cannot be traced on the meta device)."""
    from meshplan.runtime import mesh as mesh_mod  # imports torch; only reached by `train`
    preflight.check_rendezvous(nnodes=job.nnodes, node_rank=job.node_rank, rdzv_endpoint=job.rdzv_endpoint,
                               nproc_per_node=job.nproc_per_node, world_size=job.world_size,
                               plan_gpus=job.plan.num_gpus)
    preflight.check_lr(job.lr)
    preflight.check_weak_links(job.plan, nnodes=job.nnodes, nodes_per_dc=job.nodes_per_dc, outer_lr=job.outer_lr,
                               outer_momentum=job.outer_momentum)
    preflight.check_output_file("--metrics", job.metrics)
    check_flags(job)
    if job.ingested:
        from meshplan.runtime import generic  # imports torch
        hetero.check_buckets(job.plan, job.lengths, ingested=True)
        if job.data != "corpus":
            raise MeshplanError(generic.data_refusal(job.model), hint="drop --data")
        est, graph = generic.preflight(job)
        check_checkpoint_dir(job)
        if job.checkpoint_every and not job.checkpoint_dir:
            raise MeshplanError("--checkpoint-every needs --checkpoint-dir")
        return est, graph
    assert isinstance(job.model, ModelSpec) and job.seq_len is not None
    mesh_mod.check_supported(job.model, job.plan, job.world_size, job.seq_len,
                             micro=min(hetero.micro_counts(job.plan, job.global_batch)))
    preflight.check_seq_len(job.model, job.seq_len)
    hetero.check_batch(job.plan, job.global_batch)  # dp x micro_batch, or the dp_shares
    hetero.check_lengths(job.plan, job.lengths)
    preflight.check_plan(job.model, job.plan, job.global_batch, job.seq_len, nodes=job.nnodes,  # the planner's
                         nodes_per_dc=job.nodes_per_dc)                                       # constraints
    check_checkpoint_dir(job)
    if job.checkpoint_every and not job.checkpoint_dir:
        raise MeshplanError("--checkpoint-every needs --checkpoint-dir")
    return check_memory(job), None


def check_checkpoint_dir(job: Any) -> int:
    """--checkpoint-dir, --resume and --overwrite (any job with those fields): with --resume a
    checkpoint of this model before --steps; without, a directory that holds no checkpoint yet (or
    --overwrite). Returns the step the run starts from."""
    if job.overwrite and job.resume:
        raise MeshplanError("--overwrite and --resume contradict each other",
                            hint="--resume continues the checkpoint, --overwrite deletes it; drop one")
    if job.overwrite and not job.checkpoint_dir:
        raise MeshplanError("--overwrite needs --checkpoint-dir", hint="drop --overwrite")
    if job.resume:
        if not job.checkpoint_dir:
            raise MeshplanError("--resume needs --checkpoint-dir")
        from meshplan.runtime.checkpoint import check_outer, check_resumable, read_meta
        step = check_resumable(job.checkpoint_dir, job.model, steps=job.steps)
        check_outer(job.checkpoint_dir, read_meta(job.checkpoint_dir) or {}, job.plan, workers_of(job))
        return step
    preflight.check_new_checkpoint_dir(job.checkpoint_dir, overwrite=job.overwrite)
    return 0


def workers_of(job: Any, procs_per_node: int | None = None) -> int:
    """Inner groups of the job's plan on its topology (1: synchronous; periodic.inner_dp_of)."""
    plan = job.plan
    if not plan.periodic:
        return 1
    from meshplan.runtime.periodic import inner_dp_of
    return plan.dp // inner_dp_of(plan, procs_per_node or job.nproc_per_node, getattr(job, "nodes_per_dc", None))


def check_memory(job: Job) -> Any:
    """preflight.check_memory for this preset job on this machine (CUDA: device 0's memory)."""
    import torch
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return preflight.check_memory(job.model, job.plan, job.global_batch, job.seq_len,
                                      nproc_per_node=job.nproc_per_node, nnodes=job.nnodes, device_type="cuda",
                                      available_gib=props.total_memory / 2**30, device_name=props.name,
                                      nodes_per_dc=job.nodes_per_dc, optimizer=job.optimizer)
    return preflight.check_memory(job.model, job.plan, job.global_batch, job.seq_len,
                                  nproc_per_node=job.nproc_per_node, nnodes=job.nnodes, device_type="cpu",
                                  nodes_per_dc=job.nodes_per_dc, optimizer=job.optimizer)


# ---- --replan-after and --switch ------------------------------------------------------------------
def calibration_path(job: Any) -> str | None:
    """Where the check writes its calibration: ``RUN.calibration.json`` beside --metrics RUN.jsonl,
    else ``replan-calibration.json`` in --checkpoint-dir; None when neither is given."""
    if job.metrics:
        p = Path(job.metrics)
        return str(p.with_name((p.stem if p.suffix else p.name) + ".calibration.json"))
    if job.checkpoint_dir:
        return str(Path(job.checkpoint_dir) / CALIBRATION_NAME)
    return None


def check_flags(job: Any) -> None:
    """--replan-after and --switch against the rest of the request (before anything starts)."""
    n, switch = getattr(job, "replan_after", None), getattr(job, "switch", False)
    if switch and n is None:
        raise MeshplanError("--switch needs --replan-after N (it switches plans at that check)",
                            hint="e.g. --replan-after 3 --switch: check the plan after 3 steps, switch if a better "
                                 "one is predicted")
    if n is None:
        return
    if n < 2:
        raise MeshplanError(f"--replan-after {n}: the check needs at least 2 steps (the first step is warm-up, "
                            "left out of the measured step time)",
                            hint="pass --replan-after 2 or more, or leave it out")
    if switch and not job.checkpoint_dir:
        raise MeshplanError("--switch needs --checkpoint-dir: the run is checkpointed at the check and resumed "
                            "under the better plan from that checkpoint", hint="add --checkpoint-dir DIR")
    path = calibration_path(job)
    if path is None:
        raise MeshplanError("--replan-after writes the calibration it fits beside --metrics FILE or into "
                            "--checkpoint-dir, and neither is given", hint="add --metrics run.jsonl")
    if job.metrics:
        from meshplan.paths import check_output_file
        check_output_file("--replan-after's calibration", path)


def check_steps(job: Any, start: int) -> None:
    """The check must leave steps to run: N steps after ``start`` (the resumed step) before --steps."""
    n = getattr(job, "replan_after", None)
    if n and start + n >= job.steps:
        left = job.steps - start
        raise MeshplanError(f"--replan-after {n}: the run has {left} step{'s' * (left != 1)} to go "
                            f"(--steps {job.steps}{f', resumed at step {start}' if start else ''}), so no step would "
                            "run after the check", hint=f"pass --replan-after below {left}, or more --steps")


