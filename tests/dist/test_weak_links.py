"""Weak links in `meshplan train` (runtime/periodic.py): DiLoCo and local SGD across inner groups,
gradient compression (DDP hooks: bf16, fp8, PowerSGD; FSDP2's bf16 reduce), checkpoints in the
middle of an outer period, sync_scope=node on two launchers of one machine. tiny-llama, fp32, gloo,
4 processes, 8 x 32 tokens a step.

Tolerances: fp32 comparisons of the same algorithm summed in other orders, within FP32 (1e-5
relative, the runtime's parity tolerance); compressed runs against the uncompressed one within
COMPRESSED x the wire format's machine epsilon (torch.finfo), and further apart than FP32 (the
compression ran).
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, meshplan_train, run_env

torch = pytest.importorskip("torch")

COMMON = ["--model", "tiny-llama", "--global-batch", "8", "--seq-len", "32", "--pg-timeout", "60",
          "--nproc-per-node", "4"]
DILOCO = "dp=4,grad_sync=diloco,sync_every=4,sync_scope=all,precision=fp32"
SGD = ["--optimizer", "sgd", "--lr", "0.1", "--grad-clip", "0"]
"""Plain SGD (momentum 0.9), no clipping: local SGD with sync_every=1 is then data parallel exactly."""
STEPS = 12
FP32 = 1e-5
COMPRESSED = 1.0
"""Loss differences of a compressed run, in units of its averaged gradient's error bound: ROUNDINGS
x half its format's epsilon (bf16 2^-7, fp8 e4m3 2^-3), each rounding to the format being within
half a step (eps / 2 relative) of the value rounded."""
ROUNDINGS = {"bf16_ddp": 2, "bf16_fsdp": 2, "fp8_ddp": 2, "fp8_fsdp": 1}
"""Roundings to the wire format on the way from a rank's gradient to the average: bf16 (DDP hook,
FSDP2 reduce_dtype) the cast and the sum in bf16; fp8 under DDP the two-shot all-reduce's two
quantisations (each rank's slice, then the fp32 sum of a slice: error <= eps/2 mean|g| + eps/2
|mean| ~ eps, twice the one-shot all-gather's eps/2); fp8 under FSDP2 the reduce-scatter's one (its
sum is fp32). Measured (12 SGD steps on 2 ranks): 0.23 and 0.07 eps (bf16: DDP, FSDP2), 0.05 and 0.06
eps (fp8: DDP two-shot, FSDP2)."""


def ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, p.stderr[-4000:]


def losses(path: Path) -> list[float]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    return [r["loss"] for r in sorted(steps, key=lambda r: r["step"])]


def train(tmp: Path, name: str, plan: str, *extra: str, steps: int = STEPS) -> list[float]:
    m = tmp / f"{name}.jsonl"
    nproc = Plan_gpus(plan)
    ok(meshplan_train(*COMMON[:-1], str(nproc), "--plan", plan, "--steps", str(steps), "--metrics", str(m), *extra))
    return losses(m)


def Plan_gpus(plan: str) -> int:  # noqa: N802 - the processes a plan string needs
    from meshplan.spec.plan import parse_plan
    return parse_plan(plan).num_gpus


def rel(a: list[float], b: list[float]) -> list[float]:
    assert len(a) == len(b)
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    """Every launch the tests compare, once."""
    d = tmp_path_factory.mktemp("weak")
    out = {"diloco": train(d, "diloco", DILOCO),
           "dp_sgd": train(d, "dp_sgd", "dp=4,precision=fp32", *SGD),
           "local_sgd": train(d, "local_sgd", "dp=4,grad_sync=local-sgd,sync_every=1,precision=fp32", *SGD),
           "powersgd": train(d, "powersgd", "dp=4,grad_compression=powersgd,compression_rank=2,precision=fp32", *SGD),
           # compression on 2 processes (quicker launches): against dp=2 uncompressed
           "dp2_sgd": train(d, "dp2_sgd", "dp=2,precision=fp32", *SGD),
           "bf16_ddp": train(d, "bf16_ddp", "dp=2,grad_compression=bf16,precision=fp32", *SGD),
           "bf16_fsdp": train(d, "bf16_fsdp", "dp=2,zero=3,grad_compression=bf16,precision=fp32", *SGD),
           "fp8_ddp": train(d, "fp8_ddp", "dp=2,grad_compression=fp8,precision=fp32", *SGD),
           "fp8_fsdp": train(d, "fp8_fsdp", "dp=2,zero=3,grad_compression=fp8,precision=fp32", *SGD)}
    # the DiLoCo run again, stopped after 6 steps (half way through the second outer period) and resumed
    ck, m = d / "ck", d / "resumed.jsonl"
    ok(meshplan_train(*COMMON, "--plan", DILOCO, "--steps", "6", "--checkpoint-dir", str(ck), "--metrics", str(m)))
    out["meta"] = json.loads((ck / "meta.json").read_text())  # type: ignore[assignment]
    p = meshplan_train(*COMMON, "--plan", DILOCO, "--steps", str(STEPS), "--checkpoint-dir", str(ck), "--resume",
                       "--metrics", str(m))
    ok(p)
    assert "resumed from" in p.stderr
    out["resumed"] = losses(m)
    return out


# ---- DiLoCo --------------------------------------------------------------------------------------
def test_diloco_runs_and_learns(runs: dict) -> None:
    loss = runs["diloco"]
    assert len(loss) == STEPS and loss[-1] < loss[0] - 0.5, loss


def diloco_reference(steps: int, workers: int, dp: int, every: int, *, lr: float = 1e-3, outer_lr: float = 0.7,
                     mu: float = 0.9, clip: float = 1.0, overlap: int = 0) -> list[float]:
    """DiLoCo in one process, written from the paper: ``workers`` copies of tiny-llama from the same
    initial weights; worker g trains on the rows of dp ranks g*n .. (g+1)*n-1 of each global batch
    (n = dp / workers), one row at a time with its loss divided by the worker's rows (the runtime's
    micro-batches and data-parallel average), clipped to ``clip``, AdamW (the runtime's settings);
    every ``every`` steps the outer gradient anchor - params, averaged over the workers, makes an
    outer SGD step with Nesterov momentum on the anchor, and every worker restarts from it. Returns
    the mean loss over the workers per step.

    ``overlap`` = tau > 0: streaming DiLoCo's delayed outer step (docs/runtime.md): the outer step
    at t is computed from the parameters at t as above, the workers go on training from their own
    parameters, and after step t + tau each adds new anchor - its parameters at t."""
    from meshplan.runtime.data import global_batch, rank_rows
    from meshplan.runtime.models import build_model, loss_fn
    from meshplan.runtime.train import ADAMW
    from meshplan.spec.io import load_model
    spec = load_model("tiny-llama")
    models = [build_model(spec, 32, seed=0) for _ in range(workers)]
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, **ADAMW) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    momentum = [torch.zeros_like(a) for a in anchor]
    n = dp // workers
    out = []
    pending: tuple[int, list[list[torch.Tensor]]] | None = None
    for step in range(steps):
        tokens = global_batch(step, batch=8, seq_len=32, vocab=spec.vocab_size)
        step_losses = []
        for g, (model, opt) in enumerate(zip(models, opts)):
            parts = [rank_rows(tokens, r, dp) for r in range(g * n, (g + 1) * n)]
            x, y = torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for i in range(x.shape[0]):
                loss = loss_fn(model(x[i:i + 1]), y[i:i + 1]) / x.shape[0]
                loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            step_losses.append(total)
        out.append(sum(step_losses) / workers)
        if pending is not None and step + 1 == pending[0]:
            with torch.no_grad():
                for m, corr in zip(models, pending[1]):
                    for p, c in zip(m.parameters(), corr):
                        p += c
            pending = None
        if (step + 1) % every == 0:
            with torch.no_grad():
                at_t = [[p.detach().clone() for p in m.parameters()] for m in models]
                for i, a in enumerate(anchor):
                    delta = sum(a - w[i] for w in at_t) / workers
                    momentum[i] = mu * momentum[i] + delta
                    a -= outer_lr * (delta + mu * momentum[i])
                if overlap:
                    pending = (step + 1 + overlap, [[a - x for a, x in zip(anchor, w)] for w in at_t])
                    continue
                for m in models:
                    for p, a in zip(m.parameters(), anchor):
                        p.copy_(a)
    return out


def test_diloco_matches_one_process_reference(runs: dict) -> None:
    ref = diloco_reference(STEPS, workers=4, dp=4, every=4)
    assert max(rel(runs["diloco"], ref)) <= FP32, (runs["diloco"], ref)
    # the outer step matters: a run whose outer sync averaged the parameters (outer lr 1, no
    # momentum: local SGD) is far from it after the first outer step
    plain = diloco_reference(6, workers=4, dp=4, every=4, outer_lr=1.0, mu=0.0)
    assert min(rel(runs["diloco"][4:6], plain[4:6])) > 100 * FP32


def test_resume_in_the_middle_of_an_outer_period(runs: dict) -> None:
    """Saved at step 6 (2 steps into the second period of 4), resumed to 12: the losses of the
    uninterrupted run, exactly."""
    assert runs["meta"]["step"] == 6
    assert runs["meta"]["outer"] == {"grad_sync": "diloco", "workers": 4, "sync_every": 4, "anchor": True}
    assert runs["resumed"] == runs["diloco"]


# ---- overlapped outer sync (sync_overlap = tau) ----------------------------------------------------
OVERLAP_RESUME = 5
"""The tau=2 run stopped after step 5: its sync of step 4 is in flight (applied after step 6)."""


@pytest.fixture(scope="module")
def overlap_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("overlap")
    out: dict = {f"diloco_tau{t}": train(d, f"diloco_tau{t}", f"{DILOCO},sync_overlap={t}") for t in (1, 2)}
    out["local_sgd_tau1"] = train(d, "local_sgd_tau1", "dp=4,grad_sync=local-sgd,sync_every=4,sync_overlap=1,"
                                  "precision=fp32")
    ck, m = d / "ck", d / "resumed.jsonl"
    plan = f"{DILOCO},sync_overlap=2"
    ok(meshplan_train(*COMMON, "--plan", plan, "--steps", str(OVERLAP_RESUME), "--checkpoint-dir", str(ck),
                      "--metrics", str(m)))
    out["meta"] = json.loads((ck / "meta.json").read_text())
    p = meshplan_train(*COMMON, "--plan", plan, "--steps", str(STEPS), "--checkpoint-dir", str(ck), "--resume",
                       "--metrics", str(m))
    ok(p)
    assert "resumed from" in p.stderr and "sync_overlap" not in p.stderr  # (no "runs as" note any more)
    out["resumed"] = losses(m)
    return out


@pytest.mark.parametrize("tau", [1, 2])
def test_overlapped_diloco_matches_delayed_reference(runs: dict, overlap_runs: dict, tau: int) -> None:
    """sync_overlap = tau: the outer sync of step t runs under inner steps t+1 .. t+tau and is
    applied after step t+tau (params = their progress since t + the new anchor): the one-process
    reference of the same delayed algorithm within fp32 rounding; losses from step t+1 on differ
    from the blocking run's, which starts step t+1 from the new anchor (the overlap ran)."""
    got = overlap_runs[f"diloco_tau{tau}"]
    ref = diloco_reference(STEPS, workers=4, dp=4, every=4, overlap=tau)
    assert max(rel(got, ref)) <= FP32, (got, ref)
    blocking = runs["diloco"]
    assert max(rel(got[:4], blocking[:4])) <= FP32  # the same until the first sync
    d = rel(got[4:8], blocking[4:8])
    assert max(d) > 100 * FP32 and min(d) > 10 * FP32, (got, blocking)  # measured 7e-4 .. 1.3e-2


def test_overlapped_local_sgd_matches_delayed_reference(overlap_runs: dict) -> None:
    """Local SGD (every 4 steps, AdamW) with tau=1: the delayed reference with an averaging outer
    step (outer lr 1, no momentum: anchor - mean delta = the mean)."""
    got = overlap_runs["local_sgd_tau1"]
    ref = diloco_reference(STEPS, workers=4, dp=4, every=4, outer_lr=1.0, mu=0.0, overlap=1)
    assert max(rel(got, ref)) <= FP32, (got, ref)
    blocking = diloco_reference(5, workers=4, dp=4, every=4, outer_lr=1.0, mu=0.0)
    assert rel(got[4:5], blocking[4:5])[0] > 100 * FP32  # step 5: on the average (blocking) or not


def test_resume_with_a_sync_in_flight(overlap_runs: dict) -> None:
    """Saved after step 5 with the sync of step 4 in flight (tau=2): waited for and saved as
    pending (meta.json's in_flight), applied after step 6 of the resumed run: the uninterrupted
    run's losses, exactly."""
    meta = overlap_runs["meta"]
    assert meta["step"] == OVERLAP_RESUME
    assert meta["outer"] == {"grad_sync": "diloco", "workers": 4, "sync_every": 4, "anchor": True, "in_flight": 4}
    assert overlap_runs["resumed"] == overlap_runs["diloco_tau2"]


# ---- local SGD -----------------------------------------------------------------------------------
def test_local_sgd_every_step_is_data_parallel(runs: dict) -> None:
    """Averaging SGD-with-momentum models after every step is data parallelism (the updates are
    linear in the gradients; no clipping): the same losses within fp32 rounding."""
    assert max(rel(runs["local_sgd"], runs["dp_sgd"])) <= FP32
    assert runs["dp_sgd"][-1] < runs["dp_sgd"][0] - 1.0


# ---- compression ---------------------------------------------------------------------------------
def test_powersgd_runs_and_learns(runs: dict) -> None:
    """PowerSGD's hook all-reduces plainly for its first 2 steps (start_powerSGD_iter=2): losses
    1-3 are data parallel's; from step 4 its rank-2 gradients give other losses."""
    loss, dp = runs["powersgd"], runs["dp_sgd"]
    assert loss[-1] < loss[0] - 1.0, loss
    assert max(rel(loss[:3], dp[:3])) <= FP32
    assert min(rel(loss[3:5], dp[3:5])) > 100 * FP32


@pytest.mark.parametrize("name,dtype", [("bf16_ddp", torch.bfloat16), ("bf16_fsdp", torch.bfloat16),
                                        ("fp8_ddp", torch.float8_e4m3fn), ("fp8_fsdp", torch.float8_e4m3fn)])
def test_compressed_gradients(runs: dict, name: str, dtype: torch.dtype) -> None:
    """bf16 (DDP's hook; FSDP2's reduce_dtype) and fp8 (DDP's hook: the two-shot all-reduce; FSDP2's
    custom reduce-scatter): the first loss is the same (no update yet), later ones differ from the
    fp32 run by more than fp32 rounding and by less than COMPRESSED x ROUNDINGS x eps / 2."""
    loss, dp = runs[name], runs["dp2_sgd"]
    d = rel(loss, dp)
    assert d[0] <= FP32
    assert max(d[1:]) > 10 * FP32, d
    assert max(d) <= COMPRESSED * ROUNDINGS[name] * torch.finfo(dtype).eps / 2, d
    assert loss[-1] < loss[0] - 1.0


def test_fp8_round_trip_is_within_half_a_step() -> None:
    """fp8_quantize / fp8_dequantize: each value within half an e4m3 step of its block's scale
    (relative 2^-4 for normal values, 2^-10 x scale in the subnormal range); zeros stay zero."""
    from meshplan.runtime.periodic import FP8_BLOCK, FP8_MAX, fp8_dequantize, fp8_quantize
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * FP8_BLOCK + 5, generator=g) * torch.logspace(-6, 2, 3 * FP8_BLOCK + 5)
    x[:FP8_BLOCK] = 0.0
    back = fp8_dequantize(fp8_quantize(x), x.numel())

    def bound(v: torch.Tensor) -> torch.Tensor:
        blocks = torch.nn.functional.pad(v, (0, (-v.numel()) % FP8_BLOCK)).view(-1, FP8_BLOCK)
        scale = (blocks.abs().amax(1) / FP8_MAX).repeat_interleave(FP8_BLOCK)[:v.numel()]
        return torch.maximum(v.abs() * 2.0**-4, scale * 2.0**-10)
    assert torch.all((back - x).abs() <= bound(x))
    assert torch.all(back[:FP8_BLOCK] == 0)
    assert fp8_quantize(x).numel() == 4 * FP8_BLOCK + 4 * 4  # a byte a value, 4 per block's scale
    # the two-shot all-reduce's local pieces, for 2 ranks in one process: the written-out arithmetic
    from meshplan.runtime.periodic import fp8_chunk, fp8_pack, fp8_reduce_slice, fp8_unpack
    xs = [x, torch.randn(x.numel(), generator=g)]
    chunk = fp8_chunk(x.numel(), 2)
    sent = [fp8_pack(v, 2, chunk) for v in xs]  # (rank j's row for rank j)
    slices = [fp8_reduce_slice(torch.stack([sent[0][j], sent[1][j]]), chunk, 2) for j in range(2)]
    ref, _, _ = fp8_two_shot_reference(xs)
    assert torch.equal(fp8_unpack(torch.stack(slices), chunk, x.numel()), ref)
    assert sent[0].shape == (2, chunk + 4 * chunk // FP8_BLOCK)  # a byte a value, 4 per block's scale


# ---- the two-shot fp8 all-reduce on 4 processes -----------------------------------------------------
FP8_SIZES = (10, 4 * 1024, 3 * 4 * 1024 + 517, 6 * 1024)
"""Buffer lengths: shorter than one block, one block a rank, not a multiple of 4 x 1,024 (padding),
and one with a block of zeros (chunk 2 x 1,024: rank 1's slice starts with zeros everywhere)."""

FP8_SCRIPT = """
import sys, torch, torch.distributed as dist
from meshplan.runtime.periodic import Compression, mean_over
sys.path.insert(0, sys.argv[2])
from test_weak_links import FP8_SIZES, fp8_inputs
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = {}
for n in FP8_SIZES:
    x = fp8_inputs(rank, n)
    hook = [x[:n // 3].clone(), x[n // 3:].clone().view(-1, 1)]  # two gradients, one flat bucket
    Compression("fp8").mean(hook, dist.group.WORLD)  # the manual path: fp8_hook on a FlatBucket
    out[n] = {"hook": torch.cat([g.reshape(-1) for g in hook]), "outer": mean_over(x.clone(), None, "fp8")}
torch.save(out, f"{sys.argv[1]}/fp8.rank{rank}.pt")
dist.destroy_process_group()
"""


def fp8_inputs(rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s buffer: normal values over 8 decades (blocks of very different scales)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, generator=g) * torch.logspace(-6, 2, n)[torch.randperm(n, generator=g)]
    if n == 6 * 1024:
        x[2048:3072] = 0.0
    return x


def fp8_two_shot_reference(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two-shot fp8 mean written out with torch ops (not periodic.py's): each rank's slice j
    (ceil(n / (W x 1024)) blocks of 1,024, zero-padded) scaled per block by amax / 448 and rounded
    to e4m3; rank j sums the W dequantised slices in rank order in fp32 and divides by W, rounds
    its slice to e4m3 the same way; the slices are concatenated. Returns (the result, the fp32
    mean of the first quantisation, the exact fp32 mean)."""
    block, top, world, n = 1024, 448.0, len(xs), xs[0].numel()
    chunk = -(-n // (world * block)) * block

    def rounded(v: torch.Tensor) -> torch.Tensor:
        v = torch.nn.functional.pad(v, (0, chunk - v.numel())).view(-1, block)
        scale = v.abs().amax(dim=1, keepdim=True) / top
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return ((v / scale).clamp(-top, top).to(torch.float8_e4m3fn).float() * scale).reshape(-1)
    padded = [torch.nn.functional.pad(x, (0, world * chunk - n)) for x in xs]
    firsts, results = [], []
    for j in range(world):
        total = torch.zeros(chunk)
        for x in padded:
            total += rounded(x[j * chunk:(j + 1) * chunk])
        total /= world
        firsts.append(total)
        results.append(rounded(total))
    exact = torch.stack(xs).sum(0) / world
    return torch.cat(results)[:n], torch.cat(firsts)[:n], exact


def e4m3_error_bound(v: torch.Tensor) -> torch.Tensor:
    """Largest error of one e4m3 rounding of each value of ``v`` scaled per block of 1,024 (the
    blocks as the slices cut them: from the start of ``v``): half a step, 2^-4 relative for normal
    values, 2^-10 x the block's scale below e4m3's smallest normal (2^-6 x scale)."""
    blocks = torch.nn.functional.pad(v, (0, (-v.numel()) % 1024)).view(-1, 1024)
    scale = (blocks.abs().amax(1) / 448.0).repeat_interleave(1024)[:v.numel()]
    return torch.maximum(v.abs() * 2.0**-4, scale * 2.0**-10)


def test_fp8_two_shot_all_reduce_on_4_processes(tmp_path: Path) -> None:
    """periodic.fp8_hook (through the manual path's FlatBucket) and the outer sync's fp8 mean on 4
    gloo processes: equal, on every rank, to the written-out two-shot arithmetic (all_to_all of
    e4m3 slices, fp32 sum of a rank's slice, e4m3 all_gather); within the two roundings' bound of
    the exact mean: |error| <= mean over ranks of the first rounding's bound + the second's bound
    (each half an e4m3 step: about 2 x 2^-4 = eps(e4m3) of the values' size, where the one-shot
    all-gather had one rounding, eps / 2)."""
    script = tmp_path / "fp8_two_shot.py"
    script.write_text(FP8_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(script),
           str(tmp_path), str(Path(__file__).parent)]
    p = subprocess.run(cmd, env=run_env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    got = [torch.load(tmp_path / f"fp8.rank{r}.pt") for r in range(4)]
    for n in FP8_SIZES:
        xs = [fp8_inputs(r, n) for r in range(4)]
        ref, first, exact = fp8_two_shot_reference(xs)
        for r in range(4):
            assert torch.equal(got[r][n]["hook"], ref), (n, r, (got[r][n]["hook"] - ref).abs().max())
            assert torch.equal(got[r][n]["outer"], ref), (n, r)
        bound = sum(e4m3_error_bound(x) for x in xs) / 4 + e4m3_error_bound(first)
        assert torch.all((ref - exact).abs() <= bound * (1 + 1e-5)), n
        assert not torch.equal(ref, exact)


# ---- sync_scope=node: two launchers on one machine -----------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_node_scope_on_two_nodes(tmp_path: Path) -> None:
    """dp=4 on 2 nodes of 2 processes (two `meshplan train` launchers sharing a c10d rendezvous on
    this machine): sync_scope=node makes 2 inner groups of 2 ranks, each FSDP-sharded (zero=3), with
    a DiLoCo outer step every 2 steps across the nodes; the reference trains 2 workers on the rows of
    their 2 dp ranks each."""
    plan = "dp=4,zero=3,grad_sync=diloco,sync_every=2,sync_scope=node,precision=fp32"
    port, m = free_port(), tmp_path / "node.jsonl"
    cmd = [sys.executable, "-m", "meshplan.cli.train_cmd", *COMMON[:-2], "--nproc-per-node", "2", "--nnodes", "2",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--plan", plan, "--steps", "6", "--metrics", str(m)]
    procs = [subprocess.Popen([*cmd, "--node-rank", str(r)], env=run_env(), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    ref = diloco_reference(6, workers=2, dp=4, every=2)
    got = losses(m)
    assert max(rel(got, ref)) <= FP32, (got, ref)
    # one node alone cannot run it: all 4 dp ranks would lie in one node (spec.sync)
    p = meshplan_train(*COMMON, "--plan", plan, "--steps", "2")
    assert p.returncode != 0 and "lie in one node" in p.stderr and "Traceback" not in p.stderr


# ---- refusals and groups -------------------------------------------------------------------------
def one_error_line(p: subprocess.CompletedProcess, words: str) -> None:
    assert p.returncode != 0
    errors = [x for x in p.stderr.splitlines() if x.startswith("meshplan: error:")]
    assert len(errors) == 1 and words in errors[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_refusals_before_launch() -> None:
    one_error_line(meshplan_train(*COMMON, "--plan", "dp=4,grad_sync=diloco,sync_scope=dc", "--steps", "2"),
                   "--nodes-per-dc")
    one_error_line(meshplan_train(*COMMON, "--plan", "dp=4,precision=fp32", "--steps", "2", "--outer-lr", "0.5"),
                   "grad_sync=diloco")
    one_error_line(meshplan_train(*COMMON, "--plan", DILOCO, "--steps", "2", "--outer-momentum", "1"),
                   "--outer-momentum must be a finite number >= 0 and < 1")
    one_error_line(meshplan_train(*COMMON, "--plan", "dp=4,grad_sync=diloco,ep=2", "--model", "tiny-moe",
                                  "--steps", "2"), "ep=2")


def test_inner_groups_by_scope() -> None:
    """periodic.inner_dp_of: the dp ranks of one inner group per scope and topology."""
    from meshplan.errors import MeshplanError
    from meshplan.runtime.periodic import inner_dp_of
    from meshplan.spec.plan import parse_plan
    p = parse_plan("dp=8,grad_sync=diloco,sync_scope=node")
    assert inner_dp_of(p, procs_per_node=4) == 4
    assert inner_dp_of(parse_plan("dp=4,tp=2,grad_sync=local-sgd,sync_scope=node"), procs_per_node=4) == 2
    assert inner_dp_of(parse_plan("dp=8,grad_sync=diloco"), procs_per_node=8) == 1
    assert inner_dp_of(parse_plan("dp=8,grad_sync=diloco,sync_scope=dc"), procs_per_node=2, nodes_per_dc=2) == 4
    assert inner_dp_of(parse_plan("dp=8"), procs_per_node=2) == 8
    with pytest.raises(MeshplanError, match="nodes-per-dc"):
        inner_dp_of(parse_plan("dp=8,grad_sync=diloco,sync_scope=dc"), procs_per_node=2)
    with pytest.raises(MeshplanError, match="inner groups"):
        inner_dp_of(p, procs_per_node=8)
