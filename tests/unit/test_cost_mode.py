"""`meshplan plan --objective cost`: dollars in every comparison, --deadline, the price per
GPU-hour, a reason for every cluster size without a plan, and the per-size search."""
from __future__ import annotations

import json

import pytest
from clirun import run

from meshplan.cli.model_arg import load_model_arg
from meshplan.search.driver import search
from meshplan.search.explain import cost_compare_line, explain, size_reason
from meshplan.search.result import OVER_DEADLINE, apply_deadline, merge, train_days
from meshplan.search.sizes import resized
from meshplan.spec.io import load_cluster
from meshplan.spec.plan import Workload

TOKENS = "1000T"  # tiny-llama steps take microseconds: a long run gives days worth comparing
N_TOKENS = 1e15
RANGE = ["plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb", "--gpus", "1..8",
         "--global-batch", "8", "--seq-len", "64"]
WORK = Workload(global_batch=8, seq_len=64)



def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    return code, json.loads(out), err


def days(step_time_s: float, tokens_per_step: float | None = None) -> float:
    return float(train_days(step_time_s, WORK.tokens if tokens_per_step is None else tokens_per_step, N_TOKENS))


def per_size_best(capsys) -> dict[int, float]:
    """Best step time per size of RANGE (1, 2, 4, 8 GPUs), no deadline."""
    code, doc, _ = run_json(capsys, *RANGE, "--objective", "cost", "--train-tokens", TOKENS)
    assert code == 0
    return {c["num_gpus"]: c["best_step_time_s"] for c in doc["per_cluster"]}


# ---- 1. dollars in every comparison ---------------------------------------------------------

def test_cost_mode_compares_dollars_for_the_whole_run(capsys):
    code, out, err = run(capsys, *RANGE, "--objective", "cost", "--train-tokens", TOKENS, "--top", "8")
    assert code == 0, err
    head = next(line for line in out.splitlines() if line.startswith("#  plan"))
    assert head.index("$ to train") < head.index("$/M tok") < head.index("days") < head.index("step time")
    winner = next(line for line in out.splitlines() if line.startswith("winner "))
    assert "to train 1,000T tokens" in winner
    assert winner.index("$") < winner.index("per step")
    runners = [line for line in out.splitlines() if line.startswith("#") and " (tp=" in line]
    assert runners and all(("costs " in r or "ties on predicted cost" in r) and "to train" in r for r in runners)
    assert not any(" per step):" in r for r in runners)  # the time-mode sentence
    assert "cheapest first" in out


def test_cost_mode_table_is_sorted_by_dollars(capsys):
    code, doc, _ = run_json(capsys, *RANGE, "--objective", "cost", "--train-tokens", TOKENS, "--top", "10")
    assert code == 0
    usd = [t["usd"] for t in doc["train"]]
    assert usd == sorted(usd)
    assert [p["usd_per_mtok"] for p in doc["plans"]] == sorted(p["usd_per_mtok"] for p in doc["plans"])
    assert all("$" in line for line in doc["explanation"][:3])


def test_cost_compare_line_across_sizes_is_in_dollars():
    m = load_model_arg("tiny-llama")
    base = load_cluster("h100-sxm-80gb")
    one = search(m, [resized(base, 1)], WORK, objective="cost", top=1).best
    four = search(m, [resized(base, 4)], WORK, objective="cost", top=1).best
    line = cost_compare_line(one, four, "#2", N_TOKENS)
    assert "on 4 GPUs vs 1" in line and "to train 1,000T tokens" in line
    extra = (four.usd_per_mtok - one.usd_per_mtok) * N_TOKENS / 1e6
    assert ("costs +" if extra > 0 else "costs -") in line
    assert f"in {days(four.report.step_time_s):,.1f} days vs {days(one.report.step_time_s):,.1f}" in line
    per_m = cost_compare_line(one, four, "#2")  # no train tokens: per million tokens, time per step
    assert "per million tokens" in per_m and "per step vs" in per_m


def test_time_mode_keeps_step_time_comparisons(capsys):
    code, out, _ = run(capsys, *RANGE, "--top", "3")
    assert code == 0
    assert any(line.startswith("#") and " per step)" in line for line in out.splitlines())  # (#2 may tie)


# ---- 2. --deadline ----------------------------------------------------------------------------

@pytest.mark.slow  # brute force over every plan of four cluster sizes
def test_deadline_rejects_slow_plans_and_the_cheapest_that_meets_it_wins(capsys):
    best = per_size_best(capsys)
    fastest = min(best.values())
    slowest = max(best.values())
    assert fastest < slowest
    deadline = (days(fastest) + days(slowest)) / 2  # rules out the slowest size's best plan and more
    code, doc, err = run_json(capsys, *RANGE, "--train-tokens", TOKENS, "--deadline", f"{deadline:.6f}",
                              "--top", "5")
    assert code == 0, err
    assert doc["objective"] == "cost" and doc["deadline_days"] == pytest.approx(deadline)
    over = doc["rejected"][OVER_DEADLINE]
    assert over > 0 and over == sum(c["over_deadline"] for c in doc["per_cluster"])
    assert doc["considered"] == doc["feasible"] + sum(doc["rejected"].values())
    assert all(t["days"] <= deadline for t in doc["train"])
    assert OVER_DEADLINE in doc["reject_examples"] and "deadline" in doc["reject_examples"][OVER_DEADLINE]
    # The winner is the cheapest plan meeting the deadline: brute force over every feasible plan.
    m, base = load_model_arg("tiny-llama"), load_cluster("h100-sxm-80gb")
    everything = [p for n in (1, 2, 4, 8)
                  for p in search(m, [resized(base, n)], WORK, objective="cost", top=100_000).plans]
    meets = [p for p in everything if days(p.report.step_time_s) <= deadline]
    cheapest = min(meets, key=lambda p: (p.usd_per_mtok, p.plan.num_gpus, p.report.peak_memory_gib, p.plan.short()))
    assert doc["plans"][0]["short"] == cheapest.plan.short()
    assert doc["plans"][0]["num_gpus"] == cheapest.plan.num_gpus
    slow = [n for n, t in best.items() if days(t) > deadline]
    for c in doc["per_cluster"]:
        if c["num_gpus"] in slow:
            assert c["feasible"] == 0 and "deadline" in c["reason"]


def test_deadline_text_shows_the_rejections(capsys):
    best = per_size_best(capsys)
    deadline = (days(min(best.values())) + days(max(best.values()))) / 2
    code, out, err = run(capsys, *RANGE, "--train-tokens", TOKENS, "--deadline", f"{deadline:.6f}")
    assert code == 0, err
    assert "deadline: " in out and f"  {OVER_DEADLINE}: " in out
    assert "over the deadline)" in out  # the per-size line of a size with some plans too slow, or:
    assert "no plan meets the" in out


def test_deadline_nothing_meets_says_what_would(capsys):
    # a batch big enough that 2 GPUs step faster than 1 (at RANGE's 8 x 64 tokens NCCL's per-collective
    # latency makes data parallelism slower than one GPU)
    big = ["--global-batch", "1024", "--seq-len", "64"]
    code, doc, _ = run_json(capsys, "plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb", "--gpus", "1..2",
                            *big, "--objective", "cost", "--train-tokens", TOKENS)
    best = {c["num_gpus"]: c["best_step_time_s"] for c in doc["per_cluster"]}
    one, two = days(best[1], 1024 * 64), days(best[2], 1024 * 64)
    assert two < one
    code, out, err = run(capsys, "plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:1",
                         *big, "--train-tokens", TOKENS, "--deadline", f"{(one + two) / 2:.6f}")
    assert code == 3 and err.count("\n") == 1 and "Traceback" not in err
    assert f"takes {one:,.1f} days" in err and "about 2 GPUs would meet it" in err
    assert f"{OVER_DEADLINE}: " in out


def test_deadline_nothing_meets_json_names_the_fastest(capsys):
    best = per_size_best(capsys)
    code, doc, err = run_json(capsys, "plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb:1",
                              "--global-batch", "8", "--seq-len", "64", "--train-tokens", TOKENS,
                              "--deadline", f"{days(best[1]) / 1e6:.9f}")
    assert code == 3 and "no plan trains" in err and "GPUs" in err
    miss = doc["deadline_miss"]
    assert miss["fastest"]["days"] == pytest.approx(days(best[1]), rel=1e-9)
    assert miss["fastest"]["num_gpus"] == 1 and miss["ideal_scaling_gpus"] >= 1e6
    assert doc["plans"] == [] and doc["feasible"] == 0


@pytest.mark.parametrize("argv, words", [
    (["--deadline", "30"], "--deadline needs --train-tokens"),
    (["--deadline", "soon", "--train-tokens", "1T"], "--deadline 'soon'"),
    (["--deadline", "0", "--train-tokens", "1T"], "positive number of days"),
    (["--price-per-gpu-hour", "cheap"], "--price-per-gpu-hour"),
    (["--price-per-gpu-hour", "-1"], "zero or positive"),
])
def test_bad_deadline_and_price_are_one_line(capsys, argv, words):
    code, _, err = run(capsys, *RANGE, *argv)
    assert code == 2 and err.startswith("meshplan: error: ") and words in err and err.count("\n") == 1


def test_report_refuses_deadline_clearly(capsys, tmp_path):
    code, _, err = run(capsys, "report", *RANGE[1:], "--train-tokens", "1T", "--deadline", "3",
                       "--out", str(tmp_path / "r.html"))
    assert code == 2 and "--deadline is not supported by `meshplan report`" in err


def test_apply_deadline_on_one_size_keeps_a_prefix():
    m, c = load_model_arg("tiny-llama"), load_cluster("h100-sxm-80gb:2")
    r = search(m, [c], WORK, objective="cost", top=20)
    times = sorted(p.report.step_time_s for p in r.plans)
    k = next(i for i in range(4, len(times)) if times[i] > times[i - 1])  # the first cut past 4 plans
    cut = (times[k - 1] + times[k]) / 2
    limit = days(cut)
    feasible = r.feasible
    apply_deadline(r, N_TOKENS, limit)
    assert [p.rank for p in r.plans] == list(range(1, len(r.plans) + 1))
    assert all(days(p.report.step_time_s) <= limit for p in r.plans) and len(r.plans) == k
    assert r.feasible + r.rejected[OVER_DEADLINE] == feasible
    assert len(r.points["step_time_s"]) == r.feasible and r.per_cluster[0].over_deadline == r.rejected[OVER_DEADLINE]
    assert r.fastest is not None and r.fastest.step_time_s == times[0]


# ---- 3. a reason for every size without a plan ------------------------------------------------

def test_sizes_without_a_plan_say_why(capsys):
    code, out, err = run(capsys, "plan", "--model", "llama3-70b", "--cluster", "h100-sxm-80gb", "--gpus", "1,4,8,16",
                         "--global-batch", "8", "--seq-len", "8192")
    assert code == 0, err
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if line.startswith("   ")}
    # (with parameter offload FSDP2 keeps the weights and gradients on the host: the host limits one GPU)
    assert "need more host memory for their offload" in lines["1 GPU"] and "1051 GiB per GPU" in lines["1 GPU"]
    assert "need more host memory for their offload" in lines["4 GPUs"] and "263 GiB per GPU" in lines["4 GPUs"]
    assert "of 256)" in lines["4 GPUs"]  # a GPU's share of a DGX H100's 2 TiB (issue 29 edge 7)
    assert "feasible" in lines["8 GPUs"]  # 131 GiB per GPU offloaded fits that share (128 was assumed before)
    assert "<- winner" in lines["16 GPUs"]


def test_constraint_and_mesh_failures_per_size(capsys):
    code, doc, err = run_json(capsys, "plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb",
                              "--gpus", "1,3,4", "--global-batch", "8", "--seq-len", "64")
    assert code == 0, err
    reasons = {c["num_gpus"]: c["reason"] for c in doc["per_cluster"]}
    assert reasons[1] is None and reasons[4] is None
    assert reasons[3].startswith("no plan passes the constraints; most often: ")
    code, doc, err = run_json(capsys, "plan", "--model", "tiny-llama", "--cluster", "h100-sxm-80gb",
                              "--gpus", "1..4", "--global-batch", "8", "--seq-len", "64", "--fix", "tp=2")
    assert code == 0, err
    reasons = {c["num_gpus"]: c["reason"] for c in doc["per_cluster"]}
    assert "tp=2 is more than the 1 GPU" in reasons[1] and reasons[2] is None


def test_size_reason_names_the_deadline_first():
    m, c = load_model_arg("tiny-llama"), load_cluster("h100-sxm-80gb:1")
    r = search(m, [c], WORK, objective="cost", top=3)
    apply_deadline(r, N_TOKENS, days(r.best.report.step_time_s) / 2)
    assert r.feasible == 0 and "deadline" in size_reason(r) and "days" in size_reason(r)


def test_size_reason_prefers_the_closest_memory_failure():
    from meshplan.search.constraints import AT_RISK, OUT_OF_MEMORY
    m, c = load_model_arg("tiny-llama"), load_cluster("h100-sxm-80gb:1")
    r = search(m, [c], WORK, top=1)
    r.rejected = {"batch not divisible": 50, OUT_OF_MEMORY: 5}
    r.reject_examples = {OUT_OF_MEMORY: "closest to fitting on 1 GPUs: tp=1 needs 93.1 GiB per GPU of 75.6 usable"}
    assert size_reason(r) == "no plan fits in memory (closest needs 93.1 GiB per GPU of 75.6 usable)"
    r.rejected[AT_RISK] = 2
    r.reject_examples[AT_RISK] = "tp=1 needs 70.0 GiB per GPU of 75.6 usable, closer to the limit than ..."
    assert size_reason(r).startswith("no plan fits with the memory model's headroom (closest needs 70.0 GiB")
    r.rejected = {"batch not divisible": 50, "heads not divisible": 7}
    r.reject_examples = {"batch not divisible": "dp=3: 8 is not divisible by 3"}
    assert size_reason(r) == (f"no plan passes the constraints; most often: batch not divisible (50 of "
                              f"{r.considered:,}; e.g. dp=3: 8 is not divisible by 3)")


# ---- 4. the price per GPU-hour ---------------------------------------------------------------

def test_price_is_printed_with_its_source(capsys, tmp_path):
    code, out, _ = run(capsys, *RANGE)
    assert code == 0 and "price: $2.50 per GPU-hour (from GPU preset h100-sxm-80gb" in out
    code, doc, _ = run_json(capsys, *RANGE, "--top", "1")
    assert doc["price"] == {"usd_per_gpu_hour": 2.5, "source": "GPU preset h100-sxm-80gb"}
    base = doc["plans"][0]["usd_per_mtok"]
    code, doc, _ = run_json(capsys, *RANGE, "--top", "1", "--price-per-gpu-hour", "1.25")
    assert doc["price"] == {"usd_per_gpu_hour": 1.25, "source": "--price-per-gpu-hour"}
    assert doc["plans"][0]["usd_per_mtok"] == pytest.approx(base / 2)
    path = tmp_path / "c.toml"
    path.write_text('schema_version = 1\nkind = "cluster"\nname = "mine"\ngpu = "h100-sxm-80gb"\n'
                    'num_nodes = 1\ngpus_per_node = 8\nprice_per_gpu_hour_usd = 4.0\n')
    code, doc, err = run_json(capsys, "plan", "--model", "tiny-llama", "--cluster", str(path),
                              "--global-batch", "8", "--seq-len", "64", "--top", "1")
    assert code == 0, err
    assert doc["price"]["usd_per_gpu_hour"] == 4.0 and doc["price"]["source"].startswith(f"cluster {path}")


# ---- searching size by size gives the same answer as one search ------------------------------

def test_merge_of_single_sizes_equals_one_search():
    m, base = load_model_arg("tiny-llama"), load_cluster("h100-sxm-80gb")
    clusters = [resized(base, n) for n in (1, 2, 4, 8)]
    for objective in ("time", "cost"):
        whole = search(m, clusters, WORK, objective=objective, top=7)
        parts = merge([search(m, [c], WORK, objective=objective, top=7) for c in clusters], 7)
        assert [(p.rank, p.plan.short(), p.plan.num_gpus) for p in parts.plans] == \
               [(p.rank, p.plan.short(), p.plan.num_gpus) for p in whole.plans]
        assert (parts.considered, parts.feasible, parts.evaluated, parts.rejected) == \
               (whole.considered, whole.feasible, whole.evaluated, whole.rejected)
        assert [(p.plan.short(), p.plan.num_gpus) for p in parts.pareto] == \
               [(p.plan.short(), p.plan.num_gpus) for p in whole.pareto]
        assert parts.reject_examples == whole.reject_examples
        assert [vars(c) for c in parts.per_cluster] == [vars(c) for c in whole.per_cluster]
        assert sorted(parts.points["step_time_s"]) == sorted(whole.points["step_time_s"])
        assert explain(parts) == explain(whole)
