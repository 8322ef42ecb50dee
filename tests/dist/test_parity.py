"""Every supported plan against the single-process run on the same global batch: per-step losses
and gradient norms, final weights (fp32, gloo, CPU, 5 steps), with tolerances that hold on any CPU
(see ``check_errors``); and the ZeRO levels' communication per step (``test_zero_communication``).

Three launches (2, 4 and 8 processes), several plans per launch. Only the selected cases run
(``-k 2p-zero1`` launches 2 processes for that one plan).
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import pytest
from conftest import torchrun_worker

L4 = {"num_layers": 4}


V257 = {"vocab_size": 257}
"""A vocabulary tp=2 and tp=4 do not divide (padded to 258 / 260; GPT-3's 50257 under tp=8)."""
GPT_L4_V257 = {**L4, **V257}


def case(name: str, model: str, plan: str, overrides: dict | None = None, batch: int = 8,
         resume: tuple[str, int] | None = None) -> dict:
    """``resume``: (plan, steps) the first steps run under, then a checkpoint, then ``plan``."""
    out = {"name": name, "model": model, "plan": plan + ",precision=fp32", "overrides": overrides or {},
           "global_batch": batch, "steps": 5}
    if resume is not None:
        out["resume"] = {"plan": resume[0] + ",precision=fp32", "steps": resume[1]}
    return out


CASES = {  # global batch 8: micro-batches per step = 8 / (dp x micro_batch)
    2: [case("ddp", "tiny-llama", "dp=2,zero=0,micro_batch=2"),
        case("zero1", "tiny-gpt2", "dp=2,zero=1,micro_batch=1"),  # 4 micro-batches
        case("zero1_llama", "tiny-llama", "dp=2,zero=1,micro_batch=2"),  # 2 micro-batches
        case("zero1_ep", "tiny-moe", "dp=2,ep=2,zero=1,micro_batch=1"),  # experts on their own mesh
        case("zero2", "tiny-llama", "dp=2,zero=2,micro_batch=1"),  # 4 micro-batches
        case("zero2_moe", "tiny-moe", "dp=2,zero=2,micro_batch=2"),
        case("fsdp", "tiny-llama", "dp=2,zero=3,micro_batch=2"),
        case("tp", "tiny-llama", "tp=2,micro_batch=4"),
        case("tp_sp_gpt2", "tiny-gpt2", "tp=2,sequence_parallel=1,micro_batch=4"),
        case("tp_sp_moe", "tiny-moe", "tp=2,sequence_parallel=1,micro_batch=8"),
        case("pp_gpipe_uneven", "tiny-llama", "pp=2,schedule=gpipe,micro_batch=2,stage_layers=1:3", L4),
        case("pp_1f1b", "tiny-llama", "pp=2,schedule=1f1b,micro_batch=2", L4),
        case("pp_interleaved", "tiny-llama", "pp=2,virtual_stages=2,schedule=interleaved-1f1b,micro_batch=2", L4),
        case("pp_zero_bubble", "tiny-llama", "pp=2,virtual_stages=2,schedule=zero-bubble,micro_batch=2", L4),
        case("pp_zbv", "tiny-llama", "pp=2,virtual_stages=2,schedule=zbv,micro_batch=2", L4),
        case("ac_full_layers", "tiny-llama", "dp=2,zero=3,micro_batch=2,recompute=full,recompute_layers=1"),
        case("ac_selective_tp", "tiny-llama", "tp=2,micro_batch=2,recompute=selective"),
        case("ac_op_ddp", "tiny-llama", "dp=2,micro_batch=2,recompute=op"),
        case("cp", "tiny-llama", "cp=2,micro_batch=4"),
        case("cp_fsdp_gpt2", "tiny-gpt2", "cp=2,zero=3,micro_batch=2"),
        case("ep", "tiny-moe", "dp=2,ep=2,micro_batch=2"),
        case("ep_cp_fsdp", "tiny-moe", "cp=2,ep=2,zero=3,micro_batch=4,recompute=full"),
        case("compile_cp", "tiny-llama", "cp=2,zero=2,micro_batch=4,compile=1"),
        # tied embeddings under a pipeline (tiny-gpt2: tied, learned positions); odd vocabularies
        case("pp_1f1b_gpt2", "tiny-gpt2", "pp=2,schedule=1f1b,micro_batch=2", L4),
        case("pp_interleaved_gpt2", "tiny-gpt2", "pp=2,virtual_stages=2,schedule=interleaved-1f1b,micro_batch=2", L4),
        case("pp_zbv_gpt2", "tiny-gpt2", "pp=2,virtual_stages=2,schedule=zbv,micro_batch=2", L4),  # both ends on rank 0
        case("tp_v257_gpt2", "tiny-gpt2", "tp=2,sequence_parallel=1,micro_batch=2", V257),  # 4 micro-batches
        case("tp_v257", "tiny-llama", "tp=2,micro_batch=4", V257)],  # untied, 2 micro-batches
    4: [case("hsdp", "tiny-gpt2", "dp=4,zero=3,shard_group=2,micro_batch=1"),
        case("zero1_hsdp", "tiny-llama", "dp=4,zero=1,shard_group=2,micro_batch=1"),  # 2 micro-batches
        case("zero2_tp", "tiny-llama", "tp=2,dp=2,zero=2,micro_batch=1"),  # 4 micro-batches, FSDP x TP
        case("pp_tp", "tiny-llama", "pp=2,tp=2,schedule=1f1b,micro_batch=2", L4),
        case("pp_fsdp", "tiny-llama", "pp=2,dp=2,zero=3,schedule=interleaved-1f1b,virtual_stages=2,micro_batch=1", L4),
        case("tp_fsdp", "tiny-llama", "tp=2,dp=2,zero=3,sequence_parallel=1,micro_batch=2"),
        case("tp_ddp", "tiny-llama", "tp=2,dp=2,zero=0,micro_batch=2"),
        case("cp_fsdp", "tiny-llama", "cp=2,dp=2,zero=3,micro_batch=2,offload_params=1,offload_optimizer=1"),
        case("cp_tp_sp", "tiny-llama", "cp=2,tp=2,sequence_parallel=1,micro_batch=4"),
        case("ep_fsdp", "tiny-moe", "dp=4,ep=2,zero=3,micro_batch=1"),
        case("ep_hsdp", "tiny-moe", "dp=4,ep=2,zero=3,shard_group=2,micro_batch=1"),
        case("ep_tp_fsdp", "tiny-moe", "dp=2,ep=2,tp=2,zero=3,micro_batch=2"),
        case("ep_pp_ddp", "tiny-moe", "pp=2,dp=2,ep=2,schedule=1f1b,micro_batch=2"),
        case("pp_tp_v257_gpt2", "tiny-gpt2", "pp=2,tp=2,virtual_stages=2,schedule=interleaved-1f1b,micro_batch=2",
             GPT_L4_V257),
        case("pp_fsdp_gpt2", "tiny-gpt2", "pp=2,dp=2,zero=1,schedule=1f1b,micro_batch=1", L4),
        case("pp_ddp_gpt2", "tiny-gpt2", "pp=2,dp=2,virtual_stages=2,schedule=interleaved-1f1b,micro_batch=2", L4),
        case("tp_fsdp_v257_gpt2", "tiny-gpt2", "tp=2,dp=2,zero=3,micro_batch=1", V257),  # FSDP x TP on padded rows
        # the loss on vocabulary-sharded logits under a split backward (zbv: input then weight
        # gradients; both tied ends on pipeline rank 0) with padded columns masked in the shard
        case("pp_zbv_tp_v257_gpt2", "tiny-gpt2", "pp=2,tp=2,virtual_stages=2,schedule=zbv,micro_batch=2",
             GPT_L4_V257),
        # a checkpoint resumed under another plan: tied copies and padded rows saved as one unpadded tensor
        case("resume_pp_tp_to_tp4", "tiny-gpt2", "tp=4,micro_batch=2", GPT_L4_V257,
             resume=("pp=2,tp=2,schedule=1f1b,micro_batch=2", 3)),
        case("resume_pp_fsdp_to_tp_fsdp", "tiny-gpt2", "tp=2,dp=2,zero=3,micro_batch=2", GPT_L4_V257,
             resume=("pp=2,dp=2,zero=3,virtual_stages=2,schedule=interleaved-1f1b,micro_batch=1", 3))],
    8: [case("pp_tp_fsdp", "tiny-llama", "pp=2,tp=2,dp=2,zero=3,sequence_parallel=1,schedule=1f1b,micro_batch=1", L4),
        case("pp_tp_fsdp_v257_gpt2", "tiny-gpt2", "pp=2,tp=2,dp=2,zero=3,schedule=1f1b,micro_batch=1", GPT_L4_V257)],
}
ALL = [(n, c["name"]) for n, cs in CASES.items() for c in cs]
NOTES_CASES = [(4, "cp_fsdp"), (2, "compile_cp")]
ZERO_CASES = {"zero1": 1, "zero1_llama": 1, "zero1_ep": 1, "zero1_hsdp": 1, "zero2": 2, "zero2_moe": 2,
              "zero2_tp": 2, "fsdp": 3, "hsdp": 3, "pp_fsdp": "pp", "pp_tp_fsdp": "pp", "pp_fsdp_gpt2": "pp",
              "pp_tp_fsdp_v257_gpt2": "pp"}
"""FSDP plans with several micro-batches whose collectives per step are checked: the ZeRO level
(pp = 1), or "pp" (the pipeline schedule's own accumulation, whatever the level)."""


# ---- tolerances --------------------------------------------------------------------------------
EPS32 = 2.0 ** -23
"""float32's machine epsilon (torch.finfo(torch.float32).eps)."""
FACTOR = 8.0
"""How much larger than the single-process fp32 runs' own error the distributed run's may be."""
SANE = 1e-3
"""The single-process fp32 runs must track float64 this closely (else float64 is no reference)."""


def check_errors(what: str, dist: list[float], singles: list[list[float]], exact: list[float]) -> None:
    """Per-step values (losses or gradient norms) of the distributed run against float64, with a
    tolerance taken from the computation itself, not a constant.

    Every run here is an fp32 evaluation of the same function from the same weights; they differ
    in the order of the roundings (partial sums per rank and per micro-batch, reductions over
    ranks), not in what is computed. A result's rounding error is sum_i c_i * eps * d_i over the
    roundings i (|d_i| <= 1/2), where c_i, the sensitivity of the result to rounding i, is set by
    the function and the data, the same for every order: cancellation in a gradient element,
    Adam's m / sqrt(v) on a near-zero gradient, the growth of differences over the steps. Splitting
    a length-n sum over p ranks or m micro-batches changes the roundings on a path from ~n to
    ~n/p + p + m, which does not increase the typical (random-walk, ~sqrt) error. So a correct
    distributed run strays from the exact result as far as a correct single-process run does, on
    this CPU, whose vector widths and summation kernels set both. The exact result is the float64
    run from the same fp32 initial weights (its own error, ~1e-16, is nothing here); the
    single-process scale is the largest error of three fp32 runs that differ only in order (1, 2
    and B micro-batches: one order alone can be luckily close, measured 3.5x below the others on
    one tensor), over all steps for these single numbers (whose error can be near zero by chance),
    and never below EPS32 (a value rounded once to fp32 is already eps/2 off). Bound:
    err_dist <= FACTOR * that scale; FACTOR covers the spread of the random d_i (worst measured
    ratio: docs/runtime.md). A wrong reduction (a factor 1/dp, a missing sum, a dropped gradient)
    makes an error of order 1e-3..1, thousands of times the bound.
    """
    e_s = [abs(s - x) / abs(x) for run in singles for s, x in zip(run, exact)]
    e_d = [abs(d - x) / abs(x) for d, x in zip(dist, exact)]
    assert max(e_s) < SANE, f"{what}: the fp32 reference is {max(e_s):.1e} from float64"
    bound = FACTOR * max(max(e_s), EPS32)
    assert max(e_d) <= bound, (f"{what}: distributed error {max(e_d):.2e} (per step {e_d}) > {FACTOR} x "
                               f"single-process error {max(e_s):.2e}\ndist {dist}\nsingle {singles}\n"
                               f"float64 {exact}")


def check_weights(r: dict) -> None:
    """Per tensor, the relative error of its norm-wise difference (||w - w64|| / ||w64||, a stable
    average over its elements): distributed <= FACTOR * max(largest single-process, EPS32)."""
    bad = {}
    for k, e_d in r["w_err_dist"].items():
        e_s = r["w_err_single"][k]
        assert e_s < SANE, f"{k}: the fp32 reference is {e_s:.1e} from float64"
        if e_d > FACTOR * max(e_s, EPS32):
            bad[k] = (e_d, e_s)
    assert not bad, f"rank {r['rank']}: weights off by more than {FACTOR} x the single-process error " \
                    f"(dist, single vs float64): {bad}"


# ---- launches -----------------------------------------------------------------------------------
class Launches(Mapping):
    """{nproc: results}: each launch runs when first needed, with only the cases the session selected."""

    def __init__(self, tmp: pytest.TempPathFactory, wanted: set[tuple[int, str]]) -> None:
        self.tmp, self.wanted, self.done = tmp, wanted, {}

    def __getitem__(self, n: int) -> dict:
        if n not in self.done:
            cases = [c for c in CASES[n] if (n, c["name"]) in self.wanted] or CASES[n]
            self.done[n] = torchrun_worker(self.tmp.mktemp(f"parity{n}"), n, cases)
        return self.done[n]

    def __iter__(self) -> Iterator[int]:
        return iter(CASES)

    def __len__(self) -> int:
        return len(CASES)


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Launches:
    wanted: set[tuple[int, str]] = set()
    for item in request.session.items:
        if item.module is not request.module:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "nproc" in params:
            wanted.add((params["nproc"], params["name"]))
        elif "name" in params:
            wanted |= {(n, params["name"]) for n, c in ALL if c == params["name"]}
        elif item.name == "test_cpu_notes":
            wanted |= set(NOTES_CASES)
    return Launches(tmp_path_factory, wanted)


def ranks_of(results: Mapping, nproc: int, name: str) -> list[dict]:
    ranks = results[nproc][name]
    log = results[nproc]["__log__"][0]
    assert len(ranks) == nproc, f"{len(ranks)}/{nproc} ranks reported; torchrun rc={log['rc']}\n{log['stderr']}"
    for r in ranks:
        assert r["ok"], f"rank {r['rank']}: {r.get('error')}\n{r.get('trace', '')[-2000:]}"
    return ranks


def check_loss_layout(r: dict) -> None:
    """tp > 1: the last stage's logits are a DTensor sharded on the vocabulary (padded vocab / tp
    columns per rank) and the loss's log-softmax ran on that local shard (loss_parallel), as the
    cost model charges; no rank holds the full logits. tp = 1: whole logits, no sharded softmax."""
    loss = r["loss"]
    if not r["has_last"]:
        assert loss["logits"] is None and loss["softmax_widths"] == [], (r["rank"], loss)
        return
    lg = loss["logits"]
    if r["tp"] == 1:
        assert not lg["dtensor"] and loss["softmax_widths"] == [], (r["rank"], loss)
        return
    assert lg["dtensor"] and lg["placements"] == ["Shard(2)"], (r["rank"], lg)
    assert lg["vocab"] == r["padded_vocab"] and lg["local_vocab"] * r["tp"] == lg["vocab"], (r["rank"], lg)
    assert loss["softmax_widths"] == [lg["local_vocab"]], (r["rank"], loss)


@pytest.mark.parametrize("nproc,name", ALL, ids=[f"{n}p-{c}" for n, c in ALL])
def test_matches_single_process(results: Launches, nproc: int, name: str) -> None:
    ranks = ranks_of(results, nproc, name)
    for r in ranks:
        check_errors(f"rank {r['rank']} losses", r["losses"], r["single_losses"], r["exact_losses"])
        check_errors(f"rank {r['rank']} gradient norms", r["norms"], r["single_norms"], r["exact_norms"])
        check_weights(r)
        assert r["noise_param_abs_err"] < 1e-2, r["rank"]
        assert not r["unknown_params"], r["unknown_params"]
        assert r["padding_abs_max"] == 0.0, (r["rank"], r["padding_abs_max"])  # padded rows: no gradient, no value
        assert r["tied_copies_diff"] == 0.0, (r["rank"], r["tied_copies_diff"])  # both ends: the same update
        # every gradient laid out like its parameter (a vocabulary-sharded embedding's too: DTensor's own
        # backward leaves it replicated, full-size, under TP without FSDP)
        assert not r["grad_layout_mismatch"], (r["rank"], r["grad_layout_mismatch"])
        check_loss_layout(r)
    held = set().union(*(r["params"] for r in ranks))  # pipeline stages (experts) together hold every parameter
    assert held == set(ranks[0]["ref_params"])
    case_ = next(c for c in CASES[nproc] if c["name"] == name)
    if case_["overrides"].get("vocab_size") == 257:  # the padding is exercised: 258 (tp=2) or 260 (tp=4)
        assert max(r["padded_vocab"] for r in ranks) in (258, 260), [r["padded_vocab"] for r in ranks]
    if case_["model"] == "tiny-gpt2" and "pp=2" in case_["plan"]:  # pp=2: every rank holds one end (zbv: rank 0 both)
        assert sum(r["tied_ends"] for r in ranks) == nproc, [r["tied_ends"] for r in ranks]


@pytest.mark.parametrize("name", sorted(ZERO_CASES))
def test_zero_communication(results: Launches, name: str) -> None:
    """FSDP2's all-gathers and reduce-scatters per step, G communicating FSDP parameter groups
    (blocks, experts, root), m micro-batches: zero=1 gathers once and reduce-scatters once
    (unsharded accumulation), zero=2 gathers once and reduce-scatters every micro-batch, zero=3
    gathers in every forward and again in backward and reduce-scatters every micro-batch (the cost
    model's table, parallelize.py). Under PP torch's schedule gathers once and reduce-scatters once
    per step for any level (after the first step, whose shape inference gathers too)."""
    nproc = next(n for n, c in ALL if c == name)
    for r in ranks_of(results, nproc, name):
        g, m, zero = r["fsdp_groups"], r["micro_batches"], ZERO_CASES[name]
        assert r["dp_mode"] == "fsdp" and m > 1 and g > 1, (r["dp_mode"], m, g)
        for ag, rs in r["comms"][1:] if zero == "pp" else r["comms"]:
            if zero in (1, "pp"):
                assert (ag, rs) == (g, g), (r["rank"], ag, rs, g, m)
            elif zero == 2:
                assert (ag, rs) == (g, m * g), (r["rank"], ag, rs, g, m)
            else:
                assert rs == m * g and ag > m * g, (r["rank"], ag, rs, g, m)


def test_cpu_notes(results: Launches) -> None:
    """Offload on CPU is a no-op, said once per run (and recorded by `meshplan train`)."""
    notes = ranks_of(results, 4, "cp_fsdp")[0]["notes"]
    assert len(notes) == 1 and "offload: no-op on CPU" in notes[0], notes
    assert ranks_of(results, 2, "compile_cp")[0]["notes"] == []


def test_tolerance_is_relative_to_the_computation() -> None:
    """The bound scales with the single-process error (any CPU) and rejects an error of order 1."""
    exact = [2.0, 1.9, 1.8]
    single = [[x * (1 + 3e-6) for x in exact], [x * (1 - 1e-6) for x in exact]]
    check_errors("x", [x * (1 - 2e-5) for x in exact], single, exact)  # 6.7x the single-process error
    with pytest.raises(AssertionError):
        check_errors("x", [x / 2 for x in exact], single, exact)
    with pytest.raises(AssertionError):
        check_errors("x", [x * (1 + 1e-4) for x in exact], single, exact)
    check_errors("x", [x * (1 + 5e-7) for x in exact], [exact, exact], exact)  # the EPS32 floor
    assert math.isclose(EPS32, 1.1920928955078125e-07)
