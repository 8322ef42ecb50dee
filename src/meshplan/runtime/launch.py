"""`meshplan train`: start torchrun (or run inside it), train, checkpoint, measure, compare.

``launch`` checks the request (``job.check_job``, with the pre-flight checks of ``preflight``: learning
rate, output paths, positions, the planner's constraints, the checkpoint directory, memory), says
what it is about to run (``before_launch``: more processes than CPU cores, the cost model's step
time; --overwrite deletes the old checkpoint) and runs ``python -m meshplan.runtime.launch ... -m
meshplan.cli.train_cmd ARGS``: torchrun's own launcher (``torch.distributed.run``), in a process that
reports a failed rank in one line (``failure_message``: killed by a signal, exit code) instead of
torchrun's ChildFailedError traceback. Inside torchrun ``worker_main`` trains on every rank. A
one-process plan runs in the calling process (no torchrun, no process group). One ``Job`` (job.py) for
every model: a preset (``model`` a ModelSpec) or an ingested model (``model`` its ``hf:``/``module:``
source; the checks particular to it, on its traced LayerGraph, are ``generic.preflight``).
With ``--replan-after N`` the ranks check the plan after N steps (``replan_check``, runtime/replan.py);
with ``--switch`` they checkpoint and leave a switch file, and ``launch`` starts the run again under the
better plan with ``--resume`` (``switched``).
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from meshplan.errors import MeshplanError, Terminated
from meshplan.runtime import hetero, preflight, replan
from meshplan.runtime.hetero import local_plan, micro_counts
from meshplan.runtime.job import Job, check_checkpoint_dir, check_flags, check_steps, checked_job
from meshplan.runtime.local import (
    cpu_memory,
    estimate_basis,
    local_cluster,
    run_model,
    run_plan,
    this_device_type,
)
from meshplan.runtime.preflight import check_output_file, check_plan, check_weak_links, memory_estimate
from meshplan.spec.plan import Workload

log = logging.getLogger(__name__)

SWITCH_ENV = "MESHPLAN_SWITCH_FILE"
PREDICTION_ENV = "MESHPLAN_SWITCH_PREDICTION"
"""JSON the launcher sets for a run it started again after a --switch: the plan switched to and its
step time predicted under the calibration fitted at the --replan-after check (what the switch was
decided on), so that the run's closing summary compares the measurement with it (issue 29 edge 1)."""
"""Where the ranks (local rank 0 of each node) write the plan a --switch moved the run to, as JSON for
the launcher, which then starts the run again under it (``launch``)."""
FAILURE_ENV = "MESHPLAN_TORCHRUN_FAILURE"
"""Where the torchrun wrapper (``torchrun_main``) writes the failed ranks as JSON for the launcher."""


def before_launch(job: Any, est: dict[str, Any] | None, device_type: str, steps: int) -> None:
    """What the launcher says (stderr) once the checks pass: more processes than CPU cores (a
    warning), the cost model's step time for the run (``est``: estimate_for's dict), and, with
    --overwrite, the old checkpoint deleted."""
    warn = preflight.oversubscription_warning(job.nproc_per_node, device_type)
    if warn:
        print(f"meshplan: warning: {warn}", file=sys.stderr, flush=True)
    note = preflight.step_time_note(est or {}, steps)
    if note:
        print(f"meshplan: note: {note}", file=sys.stderr, flush=True)
    if getattr(job, "overwrite", False):
        gone = preflight.clear_checkpoint_dir(job.checkpoint_dir)
        if gone:
            print(f"meshplan: note: --overwrite: deleted the checkpoint in {job.checkpoint_dir} "
                  f"({', '.join(gone)})", file=sys.stderr, flush=True)


NODE_RANK_ENV = "MESHPLAN_NODE_RANK"
"""Set by the launcher when --site derived the node rank: torchrun's c10d rendezvous numbers the nodes
in its own order (it ignores --node-rank), so each rank takes global rank node rank x LOCAL_WORLD_SIZE +
LOCAL_RANK instead (train.init_distributed)."""


NODE_FLAGS_ENV = "MESHPLAN_NODE_FLAGS"
"""With NODE_RANK_ENV: the flags that gave the node rank (``--site 1 --site-node 0``), named by train.claim_rank
when two nodes took one node rank."""


def torchrun_argv(job: Job, worker_argv: list[str]) -> list[str]:
    """torchrun's command line for the job, through ``torchrun_main`` (this module as a script)."""
    cmd = [sys.executable, "-m", "meshplan.runtime.launch", f"--nproc-per-node={job.nproc_per_node}",
           f"--nnodes={job.nnodes}", f"--max-restarts={job.max_restarts}"]
    if job.nnodes == 1 and not job.rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={job.rdzv_endpoint}", f"--node-rank={job.node_rank}"]
    return cmd + ["-m", "meshplan.cli.train_cmd"] + worker_argv


def launch(job: Job, worker_argv: list[str]) -> int:
    """Run the job: in this process for one process, else under torchrun. Returns an exit code.
    A run that --switch moved to another plan at its --replan-after check (the ranks checkpointed
    and said so in the switch file) is started again under that plan with --resume."""
    try:
        switch = _launch_once(job, worker_argv)
        while switch is not None:
            job, worker_argv = switched(job, worker_argv, switch)
            switch = _launch_once(job, worker_argv)
    finally:
        os.environ.pop(PREDICTION_ENV, None)
    return 0


def _launch_once(job: Job, worker_argv: list[str]) -> dict[str, Any] | None:
    """One launch of the job (checks, then the ranks); the switch the ranks asked for, or None."""
    est, graph = checked_job(job)
    if getattr(job, "site_ranks", False) and job.nnodes > 1 and job.rdzv_endpoint:
        with preflight.node_lock(job.rdzv_endpoint, job.node_rank, job.site_flags or "--site"):
            return _launch_checked(job, worker_argv, est, graph)
    return _launch_checked(job, worker_argv, est, graph)


def _launch_checked(job: Job, worker_argv: list[str], est: Any, graph: Any) -> dict[str, Any] | None:
    dev = this_device_type()
    start = check_checkpoint_dir(job)
    check_steps(job, start)
    before_launch(job, estimate_for(job, dev, graph), dev, job.steps - start)
    with tempfile.TemporaryDirectory(prefix="meshplan-switch-") as tmp:
        path = Path(tmp) / "switch.json"
        if job.world_size == 1:
            old = os.environ.get(SWITCH_ENV)
            os.environ[SWITCH_ENV] = str(path)
            try:
                worker_main(job)
            finally:
                if old is None:
                    os.environ.pop(SWITCH_ENV, None)
                else:
                    os.environ[SWITCH_ENV] = old
        else:
            env = {SWITCH_ENV: str(path)}
            if getattr(job, "site_ranks", False):  # train.init_distributed numbers the ranks by it
                env[NODE_RANK_ENV] = str(job.node_rank)
                env[NODE_FLAGS_ENV] = job.site_flags
            run_torchrun(torchrun_argv(job, worker_argv), job.pg_timeout_s, memory=memory_context(job, est), env=env)
        return json.loads(path.read_text()) if path.is_file() else None


def switched(job: Job, worker_argv: list[str], switch: dict[str, Any]) -> tuple[Job, list[str]]:
    """The job (and the ranks' arguments) that continues a run under the plan it switched to: that
    plan, --resume from the checkpoint written at the switch, no further check."""
    from meshplan.spec.plan import parse_plan
    to = switch["to"]
    print(f"meshplan: note: switching from {switch['from']} to {to} at step {switch['step']}: resuming from the "
          f"checkpoint in {job.checkpoint_dir}", file=sys.stderr, flush=True)
    new = replace(job, plan=parse_plan(to), plan_arg=to, resume=True, overwrite=False, replan_after=None, switch=False)
    if switch.get("predicted"):  # the calibrated prediction the switch was decided on, for the closing summary
        os.environ[PREDICTION_ENV] = json.dumps(switch["predicted"])
    return new, switched_argv(worker_argv, to)


def switched_argv(argv: list[str], plan: str) -> list[str]:
    """A rank command line (cli.train_cmd.worker_argv) with --plan ``plan``, --resume, and without
    --replan-after/--switch."""
    out: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "--plan":
            out += ["--plan", plan]
            next(it, None)
        elif a == "--replan-after":
            next(it, None)
        elif a != "--switch":
            out.append(a)
    return out if "--resume" in out else [*out, "--resume"]


def memory_context(job: Any, est: Any = None) -> str:
    """What a rank killed by SIGKILL is told about memory: the pre-flight estimate (``est``, else
    the preset cost model's) beside what there is (preflight.memory_text)."""
    if est is None and isinstance(job, Job) and not job.ingested:
        try:
            est = preflight.memory_estimate(job.model, job.plan, job.global_batch, job.seq_len, nodes=job.nnodes,
                                            nodes_per_dc=job.nodes_per_dc, optimizer=job.optimizer)
        except Exception:  # noqa: BLE001 - only words for an error message
            est = None
    return preflight.memory_text(est, job.nproc_per_node)


def run_torchrun(argv: list[str], pg_timeout_s: float, *, memory: str = "", env: dict[str, str] | None = None) -> int:
    """Run a torchrun command line (one thread per process, the process-group timeout passed on);
    a failure raises one line saying which rank failed and how (``failure_message``). ``argv``:
    ``torchrun_argv`` (through ``torchrun_main``; a plain ``torch.distributed.run`` line is run
    through it too). ``memory``: said when a rank was killed by SIGKILL. ``env``: set for the ranks."""
    if argv[1:3] == ["-m", "torch.distributed.run"]:
        argv = [argv[0], "-m", "meshplan.runtime.launch", *argv[3:]]
    env = {**os.environ, **(env or {})}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["MESHPLAN_PG_TIMEOUT"] = str(pg_timeout_s)
    with tempfile.TemporaryDirectory(prefix="meshplan-torchrun-") as tmp:
        report = Path(tmp) / "failure.json"
        env[FAILURE_ENV] = str(report)
        rc, got = _call_forwarding_signals(argv, env)
        if got is not None:  # SIGTERM or SIGINT reached the launcher: the ranks were stopped, end as Ctrl-C does
            raise KeyboardInterrupt if got == signal.SIGINT else Terminated()
        failures = None
        if rc != 0 and report.is_file():
            try:
                failures = json.loads(report.read_text())
            except (OSError, ValueError):
                failures = None
    if rc != 0:
        raise MeshplanError(failure_message(failures, rc, memory))
    return 0


def _call_forwarding_signals(argv: list[str], env: dict[str, str]) -> tuple[int, int | None]:
    """Run torchrun to its end; a SIGTERM or SIGINT this process gets meanwhile is passed on to it once
    (torchrun stops its ranks, torchrun_main exits without a traceback) instead of killing this process
    and orphaning the ranks. Returns (exit code, the signal received or None)."""
    got: list[int] = []
    proc = subprocess.Popen(argv, env=env)

    def forward(signum: int, frame: object) -> None:
        if signum not in got:
            got.append(signum)
            try:
                proc.send_signal(signum)
            except ProcessLookupError:  # pragma: no cover - it had just ended
                pass

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    main_thread = _is_main_thread()
    if main_thread:
        for s in old:
            signal.signal(s, forward)
    try:
        rc = proc.wait()
    finally:
        if main_thread:
            for s, h in old.items():
                signal.signal(s, h)
    return rc, (got[0] if got else None)


def _is_main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def failure_message(failures: list[dict[str, Any]] | None, rc: int, memory: str = "") -> str:
    """One line for a failed torchrun job. ``failures``: [{rank, exitcode, ...}], the first failure
    first (torchrun_main); a negative exit code is the signal that killed the rank."""
    if not failures:
        if rc < 0:
            return f"training failed: torchrun was killed ({signal_name(-rc)})"
        return f"training failed (torchrun exit code {rc}); see the rank errors above"
    # a rank killed by a signal is the cause; the others then lose their peer and exit (code 2, after
    # one line each) - sometimes before torchrun has noticed the killed one: name the killed rank
    # (torchrun itself sends SIGTERM to the rest: a SIGTERM is named only when no other signal is)
    codes = [int(f.get("exitcode", 1)) for f in failures]
    first = next((f for f, c in zip(failures, codes) if c < 0 and -c != signal.SIGTERM),
                 next((f for f, c in zip(failures, codes) if c < 0), failures[0]))
    rank, code = first.get("rank"), int(first.get("exitcode", 1))
    others = len(failures) - 1
    also = f"; {others} other rank{'s' if others > 1 else ''} stopped with it" if others else ""
    if code < 0:
        sig = signal_name(-code)
        if -code == signal.SIGKILL:
            why = ("most likely out of host memory (the kernel's OOM killer sends SIGKILL; "
                   "`dmesg` or `journalctl -k` says so)")
            more = f": {memory}" if memory else ""
            return (f"training failed: rank {rank} was killed ({sig}{also}), {why}{more}; try fewer processes, "
                    "a smaller model, a shorter --seq-len, a smaller micro_batch, zero=3 or recompute=full")
        if -code in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            return f"training failed: rank {rank} was terminated from outside ({sig}{also})"
        return f"training failed: rank {rank} crashed ({sig}{also}); see its output above"
    return f"training failed: rank {rank} exited with code {code}{also}; see the rank errors above"


def torchrun_main(argv: list[str]) -> int:
    """``python -m meshplan.runtime.launch TORCHRUN-ARGS``: torch.distributed.run with the same
    arguments; a failed job writes its failed ranks to $MESHPLAN_TORCHRUN_FAILURE (JSON, the first
    failure first) and exits 1 without torchrun's ChildFailedError traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run
    try:
        run(parse_args(argv))
    except (SignalException, KeyboardInterrupt) as e:  # SIGTERM/SIGINT: torchrun has stopped the ranks
        logging.disable(logging.CRITICAL)
        sig = getattr(e, "sigval", signal.SIGINT)
        return 128 + int(sig)
    except ChildFailedError as e:
        first, _ = e.get_first_failure()
        ranks = [first] + sorted(r for r in e.failures if r != first)
        failures = [{"rank": r, "local_rank": e.failures[r].local_rank, "exitcode": e.failures[r].exitcode,
                     "pid": e.failures[r].pid} for r in ranks]
        path = os.environ.get(FAILURE_ENV)
        if path:
            Path(path).write_text(json.dumps(failures))
        else:  # run by hand: say it here
            print(f"meshplan: error: {failure_message(failures, 1)}", file=sys.stderr, flush=True)
        return 1
    return 0


def exit_worker(rc: int) -> None:
    """End a torchrun worker with ``rc`` once its output is flushed, skipping the interpreter's
    teardown: after a finished job (process group destroyed, files closed), C++ destructors of
    torch/gloo threads at interpreter exit now and then abort the process ("terminate called
    without an active exception", SIGABRT) and turn a good run into a failed rank."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


def in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
"""gloo's words for a collective whose peer process is gone."""


def run_reporting_lost_peers(fn: Any, *args: Any) -> int:
    """``fn(*args)`` in a torchrun worker: a rank whose collective failed because a peer died gets
    one line (lost_peer_message) and exit 2; anything else propagates (a traceback is then right)."""
    try:
        return fn(*args)
    except Exception as e:
        msg = lost_peer_message(e)
        if msg is None:
            raise
        print(f"meshplan: error: {msg}", file=sys.stderr, flush=True)
        return 2


def lost_peer_message(e: BaseException) -> str | None:
    """Inside torchrun: one line for a rank whose collective failed because another rank died (gloo:
    connection closed/reset by peer), or that timed out waiting for the others; None for anything
    else (a traceback is then the right report). The launcher says which rank died and why."""
    if not in_torchrun() or "torch" not in sys.modules:
        return None
    import torch.distributed as dist
    text = str(e).strip()
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(e).__name__)  # gloo's [file:line]
    first = first.split(". ")[0]
    rank = os.environ.get("RANK", "?")
    if any(w in text for w in PEER_LOST):
        return (f"rank {rank} stopped: another rank of the job is gone ({type(e).__name__}: "
                f"{first[:200]})")
    if isinstance(e, dist.DistError) and "timeout" in text.lower():
        return (f"rank {rank} stopped: a collective timed out (--pg-timeout); another rank is stuck or gone "
                f"({type(e).__name__}: {first[:200]})")
    return None


# ---- inside a rank ---------------------------------------------------------------------------
def estimate_for(job: Job, device_type: str, graph: Any = None) -> dict[str, Any]:
    """The cost model's prediction of this run on this machine (``local_cluster``): presets'
    ``cost.estimate`` on the ModelSpec; ingested models' on ``graph`` (their LayerGraph at the
    run's sequence length; traced when None: generic.estimate). On CPU the peak memory is the
    pre-flight check's CPU-corrected figure (``cpu_memory``)."""
    if job.ingested:
        from meshplan.runtime import generic
        return generic.estimate(job, device_type, graph)
    from meshplan.cost import estimate
    plan = local_plan(job.plan)  # pools: placement only on this machine's one device type
    basis_more = ""
    try:
        cluster = local_cluster(job.world_size, device_type, job.nnodes, job.nodes_per_dc)
        work = Workload(global_batch=job.global_batch, seq_len=job.seq_len, optimizer=job.optimizer)
        if job.lengths is not None and len(job.lengths.lengths) > 1:
            try:
                r = estimate(job.model, cluster, plan, Workload.of(job.global_batch, job.lengths, job.optimizer))
            except (MeshplanError, ValueError, TypeError, AttributeError):  # the cost model without lengths
                r = estimate(job.model, cluster, plan, work)
                basis_more = f"; estimate at the longest length ({job.seq_len}): the cost model did not price " \
                             "the length distribution"
        else:
            r = estimate(job.model, cluster, plan, work)
    except MeshplanError as e:
        return {"error": str(e)}
    out = {"cluster": cluster.name, "basis": estimate_basis(cluster.name) + basis_more, "step_time_s": r.step_time_s,
           "peak_memory_gib": r.peak_memory_gib, "tokens_per_s": r.tokens_per_s}
    if device_type != "cuda":
        return cpu_memory(out, memory_estimate(job.model, job.plan, job.global_batch, job.seq_len, "cpu",
                                               nodes=job.nnodes, nodes_per_dc=job.nodes_per_dc,
                                               optimizer=job.optimizer))
    return out


def summary_record(job: Job, trainer: Any, records: list[Any], device_type: str, **extra: Any) -> dict[str, Any]:
    """The ``{"kind": "summary"}`` record of a run's steps ``records`` (its end, or a --switch): the
    measurement (``measured_summary``) beside the estimate, and what makes it a calibration case
    (calibration.metrics.case_from_summary): the model's spec (a ModelSpec, or an ingested model's
    LayerGraph), the cluster the estimate used, the plan as run, the batch and tokens per sample."""
    from meshplan.spec.io import spec_fields
    model = run_model(job)
    est = estimate_for(job, device_type, model if job.ingested else None)
    seq = (model.sample_tokens if model is not None else None) if job.ingested else job.seq_len
    cluster = local_cluster(job.world_size, device_type, job.nnodes, job.nodes_per_dc) if "error" not in est else None
    rec: dict[str, Any] = {
        "kind": "summary", "plan": job.plan.short(), "plan_as_run": run_plan(job.plan, device_type).short(),
        "model": trainer.model.name, **({"source": job.model} if job.ingested else {}),
        "world_size": job.world_size, "nproc_per_node": job.nproc_per_node, "nnodes": job.nnodes,
        "sample_tokens": trainer.sample_tokens, "global_batch": job.global_batch, "seq_len": seq,
        "optimizer": job.optimizer,
        "device": device_type, "profile": "meshplan",
        "steps": [records[0].step, records[-1].step] if records else None,
        "measured": measured_summary(records, trainer.tokens_per_step), "estimate": est,
        "warnings": trainer.par.notes, **extra}
    if job.lengths is not None:  # variable lengths: seq_len above is the longest; tokens/s count real tokens
        rec.update(lengths=job.lengths.text(), packing=job.lengths.packing, mean_length=job.lengths.mean_len)
    cal = switch_prediction(job)
    if cal is not None:
        rec["calibrated"] = cal
    rec.update(spec_fields(model, cluster))
    return rec


def switch_prediction(job: Job) -> dict[str, Any] | None:
    """For a run that --switch moved to this plan: {plan, step_time_s, calibration, step}, the step time
    predicted for it under the calibration the switch was decided on (PREDICTION_ENV); else None."""
    text = os.environ.get(PREDICTION_ENV)
    if not text:
        return None
    try:
        d = json.loads(text)
    except ValueError:
        return None
    return d if isinstance(d, dict) and d.get("plan") == job.plan.short() and d.get("step_time_s") else None


def _write(path: str | None, record: dict[str, Any]) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def summary_text(measured: dict[str, Any], est: dict[str, Any], calibrated: dict[str, Any] | None = None) -> str:
    """The closing table: measured beside the cost model's estimate and, after a --switch, beside the
    step time predicted under the calibration the switch was decided on (``calibrated``)."""
    lines = ["", f"{'':24}{'measured':>14}{'estimated':>14}" + (f"{'calibrated':>14}" if calibrated else "")]
    if "error" in est:
        lines.append(f"estimate unavailable: {est['error']}")
        est = {}
    for key, label, fmt in (("step_time_s", "step time (s)", "{:.4f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
                            ("peak_memory_gib", "peak memory/rank (GiB)", "{:.3f}")):
        m, e = measured.get(key), est.get(key)
        c = (calibrated or {}).get(key)
        lines.append(f"{label:24}{fmt.format(m) if m is not None else '-':>14}"
                     f"{fmt.format(e) if e is not None else '-':>14}"
                     + (f"{fmt.format(c) if c is not None else '-':>14}" if calibrated else ""))
    if calibrated:
        m = measured.get("step_time_s")
        off = f": measured {100 * (m / calibrated['step_time_s'] - 1):+.1f}% against it" if m else ""
        lines.append(f"calibrated: the step time predicted for {calibrated['plan']} under {calibrated.get('calibration')} "
                     f"(fitted at the --replan-after check after step {calibrated.get('step')}), what the switch to "
                     f"it was decided on{off}")
    if est.get("cluster"):
        basis = est.get("basis") or estimate_basis(est["cluster"])
        lines.append(f"estimated: {basis} (cluster {est['cluster']})")
        if est.get("peak_memory_basis"):
            raw = est.get("cost_model_peak_memory_gib")
            lines.append(f"estimated memory: {est['peak_memory_basis']}"
                         + (f" (the cost model's GPU figure: {raw:.3f} GiB)" if raw is not None else ""))
        cpu = est["cluster"].startswith("local-cpu")
        lines.append("measured: step time is the median after the first step"
                     + ("; memory is each process's peak RSS" if cpu else ""))
    return "\n".join(lines)


def measured_summary(records: list[Any], tokens: int) -> dict[str, Any]:
    """Median step time (the first step left out when there are others), tokens/s and peak memory
    over a run's StepRecords; empty without records."""
    times = [r.step_time_s for r in records[1:]] or [r.step_time_s for r in records]
    if not times:
        return {}
    st = statistics.median(times)
    real = [r.extra["real_tokens"] for r in records if "real_tokens" in r.extra]
    if real:  # variable lengths: the mean real tokens of a step
        tokens = statistics.mean(real)
    return {"step_time_s": st, "tokens_per_s": tokens / st, "peak_memory_gib": max(r.peak_memory_gib for r in records)}


def run_step(trainer: Any, job: Job, rank0: bool) -> Any:
    """One step of `meshplan train` on this rank: fault hook, timed step, log line and metrics
    record (rank 0), checkpoint when due. Returns the StepRecord."""
    from meshplan.runtime import checkpoint as ckpt
    from meshplan.runtime.train import maybe_fail, timed_step
    maybe_fail(trainer.step)
    rec = timed_step(trainer)
    outer, said = getattr(trainer, "outer", None), ""
    if outer is not None:  # local SGD / DiLoCo: say when an outer sync ran (or was launched)
        n = int(getattr(outer, "syncs", 0))
        if n != getattr(trainer, "_outer_syncs_logged", 0):
            trainer._outer_syncs_logged = n
            lag = int(getattr(outer, "overlap", 0) or 0)
            said = f"  outer sync {n}" + (f" (launched; applied after {lag} more step{'s' if lag > 1 else ''})"
                                          if lag else "")
        rec.extra["outer_syncs"] = n
    if rank0:
        print(f"step {rec.step:>5}/{job.steps}  loss {rec.loss:.6f}  {rec.step_time_s:.4f} s  "
              f"{rec.tokens_per_s:,.0f} tok/s  {rec.peak_memory_gib:.3f} GiB{said}", file=sys.stderr, flush=True)
        _write(job.metrics, rec.to_dict())
    if job.checkpoint_dir and job.checkpoint_every and trainer.step % job.checkpoint_every == 0:
        ckpt.save(trainer, job.checkpoint_dir)
    return rec


def worker_main(job: Job) -> int:
    """Train on this rank (or alone): resume if asked (or after a restart), log, checkpoint."""
    import torch
    import torch.distributed as dist

    from meshplan.runtime import checkpoint as ckpt
    from meshplan.runtime.mesh import build_mesh, check_supported, write_groups
    from meshplan.runtime.train import Trainer, init_distributed
    if job.ingested:
        from meshplan.runtime.generic import quiet_false_positives
        quiet_false_positives()
    check_flags(job)  # started by torchrun by hand: no launcher checked them
    check_weak_links(job.plan, nnodes=nodes_of(job), nodes_per_dc=job.nodes_per_dc, outer_lr=job.outer_lr,
                     outer_momentum=job.outer_momentum)
    if in_torchrun():
        device = init_distributed(float(os.environ.get("MESHPLAN_PG_TIMEOUT", job.pg_timeout_s)))
        if job.ingested:
            if dist.get_world_size() != job.plan.num_gpus:
                raise MeshplanError(f"plan needs {job.plan.num_gpus} processes but {dist.get_world_size()} were "
                                    "started")
        else:
            check_supported(job.model, job.plan, dist.get_world_size(), job.seq_len,
                            micro=min(micro_counts(job.plan, job.global_batch)))
            check_plan(job.model, job.plan, job.global_batch, job.seq_len, nodes=nodes_of(job),
                       nodes_per_dc=job.nodes_per_dc)
    else:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    mesh = None
    if dist.is_initialized() and dist.get_world_size() > 1:  # periodic plans: inner groups on this topology
        from meshplan.runtime.periodic import inner_dp_of
        mesh = build_mesh(job.plan, device.type, inner_dp_of(job.plan, procs_per_node(job), job.nodes_per_dc))
        write_groups(mesh)  # (only with MESHPLAN_MESH_GROUPS set: tests of the placement)
    trainer = Trainer(job.config(), mesh, device)
    if rank0:  # heterogeneous hardware and data (runtime/hetero.py): what this run does of them
        for note in (hetero.pools_note(job.plan, device.type),
                     hetero.shares_note(job.plan, job.global_batch, trainer.model.varied),
                     hetero.lengths_note(job.plan, job.lengths)):
            if note:
                print(f"meshplan: note: {note}", file=sys.stderr, flush=True)
    if rank0:  # plan fields this hardware cannot honour: said once, and kept with the metrics
        for note in trainer.par.notes:
            print(f"meshplan: warning: {note}", file=sys.stderr, flush=True)
            _write(job.metrics, {"kind": "warning", "message": note})
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if job.checkpoint_dir and (job.resume or (restarted and ckpt.read_meta(job.checkpoint_dir))):
        ckpt.load(trainer, job.checkpoint_dir)
        if rank0:
            print(f"meshplan: resumed from {job.checkpoint_dir} at step {trainer.step}", file=sys.stderr, flush=True)
    records = []
    while trainer.step < job.steps:
        records.append(run_step(trainer, job, rank0))
        if job.replan_after and len(records) == job.replan_after:
            to = replan_check(job, trainer, records, device.type, rank0)
            if to is not None and job.switch:
                switch_plan(job, trainer, records, device.type, rank0, to)
                return 0
    if job.checkpoint_dir and not (job.checkpoint_every and trainer.step % job.checkpoint_every == 0):
        if not records and ckpt.read_meta(job.checkpoint_dir):
            pass  # nothing new to save
        else:
            ckpt.save(trainer, job.checkpoint_dir)
    if rank0:
        rec = summary_record(job, trainer, records, device.type)
        print(summary_text(rec["measured"], rec["estimate"], rec.get("calibrated")), flush=True)
        _write(job.metrics, rec)
    if trainer.outer is not None:
        trainer.outer.wait()  # an overlapped outer sync still in flight: its thread's collectives end first
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def procs_per_node(job: Job) -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE (a rank), else --nproc-per-node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", job.nproc_per_node))


def nodes_of(job: Job) -> int:
    """Nodes of the job: WORLD_SIZE / LOCAL_WORLD_SIZE in a rank, else --nnodes."""
    world = int(os.environ.get("WORLD_SIZE", job.world_size))
    return max(1, world // procs_per_node(job))


def replan_check(job: Job, trainer: Any, records: list[Any], device_type: str, rank0: bool) -> str | None:
    """The --replan-after check (runtime/replan.py), on rank 0; its records go to the metrics file, its
    notes to stderr. Returns the better plan (the same on every rank: rank 0's decision is
    broadcast), or None."""
    import torch.distributed as dist

    msg: dict[str, Any] = {"to": None}
    failure: BaseException | None = None
    if rank0:
        try:
            out = replan.run_check(job, summary_record(job, trainer, records, device_type), device_type)
        except MeshplanError as e:  # e.g. the cost model refuses the plan on this device: say it, train on
            rec = {"kind": "replan-check", "step": trainer.step, "error": str(e)}
            out = replan.Outcome(records=[rec], notes=[f"replan after step {trainer.step}: no check ({e})"])
        except Exception as e:  # a bug: every rank stops (after telling the others), not a hang
            failure, out = e, replan.Outcome(records=[], notes=[])
            msg = {"to": None, "failed": f"{type(e).__name__}: {e}"}
        for r in out.records:
            _write(job.metrics, r)
        replan.say(out.notes)
        if failure is None:
            msg = {"to": out.switch_to, "predicted": out.predicted}
    if dist.is_initialized():
        box = [msg]
        dist.broadcast_object_list(box, src=0)
        msg = box[0]
    if failure is not None:
        raise failure
    if msg.get("failed"):
        raise MeshplanError(f"the --replan-after check failed on rank 0 ({msg['failed']})")
    trainer.replan_prediction = msg.get("predicted")
    return msg["to"]


def switch_plan(job: Job, trainer: Any, records: list[Any], device_type: str, rank0: bool, to: str) -> None:
    """--switch: checkpoint at this step (every rank), record the part of the run under the old plan
    (its summary, ended by the switch) and the switch, and tell the launcher (local rank 0 of each
    node writes the switch file), which starts the run again under ``to`` with --resume."""
    import torch.distributed as dist

    from meshplan.runtime import checkpoint as ckpt
    assert job.checkpoint_dir is not None  # job.check_flags
    if not (job.checkpoint_every and trainer.step % job.checkpoint_every == 0):  # not saved by run_step already
        ckpt.save(trainer, job.checkpoint_dir)
    sw = {"kind": "switch", "step": trainer.step, "from": job.plan.short(), "to": to,
          "checkpoint": str(Path(job.checkpoint_dir) / f"step-{trainer.step:08d}"),
          "predicted": getattr(trainer, "replan_prediction", None)}
    path = os.environ.get(SWITCH_ENV)
    if rank0:
        rec = summary_record(job, trainer, records, device_type, ended="switch")
        print(summary_text(rec["measured"], rec["estimate"], rec.get("calibrated")), flush=True)
        _write(job.metrics, rec)
        _write(job.metrics, sw)
        then = (f"the run goes on under {to}" if path else  # started by torchrun by hand: no launcher to go on
                f"continue it with --plan {to} --resume (no `meshplan train` launcher started this job)")
        print(f"meshplan: note: --switch: checkpoint at step {trainer.step} in {job.checkpoint_dir}; {then}",
              file=sys.stderr, flush=True)
    if path and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        Path(path).write_text(json.dumps(sw))
    if trainer.outer is not None:
        trainer.outer.wait()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def metrics_path(path: str | None) -> str | None:
    """--metrics, checked: a file in an existing, writable directory (no directory is created)."""
    return check_output_file("--metrics", path)


if __name__ == "__main__":
    sys.exit(torchrun_main(sys.argv[1:]))
