"""Ingested models (issue 5) through the whole pipeline on CPU: ingest -> search on a 2-"GPU"
CPU cluster -> the winning plan trained on 2 processes (torchrun, gloo, fp32) -> per-step losses
and gradient norms and final weights against a float64 run from the same initial weights, within
8x the error of correct single-process fp32 runs (test_parity.check_errors: tolerances that hold
on any CPU, while a wrong reduction fails by orders of magnitude). Families: HF Llama, ViT, T5,
Mixtral (MoE) configs and a small CNN (tests/data/modules/small_cnn.py); plus forced plans:
pipeline (Llama, CNN, Llama interleaved, Mixtral), TP (Llama, T5, ViT), FSDP + full recompute, and the
refusals (T5 pp, CNN tp, --data, stage_layers not counting blocks).

One torchrun launch holds every parity case; `meshplan train` runs end to end (metrics and
estimate; the pre-flight refusal before any rank starts; DDP without find_unused_parameters'
warning; a rank killed by SIGKILL in one line).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LAUNCH_TIMEOUT_S, ROOT, meshplan_train, run_env, torchrun_worker
from test_parity import EPS32, FACTOR, SANE, check_errors

pytest.importorskip("torch")
pytest.importorskip("transformers")

HF = ROOT / "tests" / "data" / "hf"
MODULES = ROOT / "tests" / "data" / "modules"
WORKER = Path(__file__).with_name("ingested_worker.py")
SOURCES = {"llama": f"hf:{HF / 'llama-tiny.json'}", "vit": f"hf:{HF / 'vit-tiny.json'}",
           "t5": f"hf:{HF / 't5-tiny-nodropout.json'}", "cnn": "module:small_cnn:make_cnn",
           "moe": f"hf:{HF / 'mixtral-tiny.json'}"}
SEQ = {"llama": 32, "t5": 32, "moe": 32}  # language models: short sequences; images: from the config
BATCH, STEPS = 4, 3
EXACT_SPREAD = 1e-12
"""Two float64 references (1 and B micro-batches) agree to float64 rounding (measured <= 6e-15)."""
MODEL_SCALE = 0.1
"""Weights: a tensor's own single-process error is no scale when it is luckily small (see check_weights)."""


def check_weights(r: dict, sane: float = SANE) -> None:
    """test_parity.check_weights, with a floor for tensors whose single-process error is luckily
    small: per tensor, distributed error vs float64 <= FACTOR x max(its largest single-process error,
    MODEL_SCALE x the largest single-process error of any tensor of the model, EPS32).

    The three single-process orders vary the batch reductions only (micro-batches); tensor
    parallelism also splits the hidden-dimension reductions of the GEMMs, which no single-process
    order varies. A tensor whose error comes from those can be close to float64 in all three
    single-process runs by chance: ViT's layers.1 v_proj.weight 4.3e-7, while the model's tensors
    stray up to 9e-6 (under tp=2: 3.0e-6, 7.0x its own single-process error, within the other
    tensors' noise). The floor is the model's scale of correct fp32 noise; a real bug (a missing or
    doubled reduction, a tensor left unsynchronised) is orders of magnitude above it."""
    scale = MODEL_SCALE * max(r["w_err_single"].values(), default=0.0)
    bad = {}
    for k, e_d in r["w_err_dist"].items():
        e_s = r["w_err_single"][k]
        assert e_s < sane, f"{k}: the fp32 reference is {e_s:.1e} from float64"
        if e_d > FACTOR * max(e_s, scale, EPS32):
            bad[k] = (e_d, e_s)
    assert not bad, f"rank {r['rank']}: weights off by more than {FACTOR} x the single-process error " \
                    f"(dist, single vs float64; model scale {scale:.1e}): {bad}"
FORCED = [("llama_pp", "llama", "pp=2,schedule=1f1b,micro_batch=1"),
          ("llama_tp", "llama", "tp=2,micro_batch=2"),
          ("llama_fsdp_ac", "llama", "dp=2,zero=3,micro_batch=1,recompute=full"),
          ("llama_zero1_ga", "llama", "dp=2,zero=1,micro_batch=1"),  # 2 micro-batches: one reduce-scatter
          ("vit_zero2_ga", "vit", "dp=2,zero=2,micro_batch=1"),  # 2 micro-batches: params kept gathered
          ("cnn_pp", "cnn", "pp=2,schedule=gpipe,micro_batch=1"),
          # interleaved: 4 chunks of llama-tiny's 4 blocks (vit-tiny has 3; stages count blocks)
          ("llama_pp_interleaved", "llama", "pp=2,virtual_stages=2,schedule=interleaved-1f1b,micro_batch=1"),
          ("vit_ddp", "vit", "dp=2,zero=0,micro_batch=1"),
          ("t5_tp", "t5", "tp=2,micro_batch=2"),
          ("moe_pp", "moe", "pp=2,schedule=1f1b,micro_batch=1")]
NAMES = [f"{f}_searched" for f in SOURCES] + [n for n, _, _ in FORCED]


def modules_env() -> dict[str, str]:
    return run_env(PYTHONPATH=f"{MODULES}:{ROOT / 'src'}")


@pytest.fixture(scope="module")
def searched() -> dict[str, str]:
    """The best plan of each family on a 2-process CPU cluster (graph search, fp32, only what the
    runtime runs: runtime.generic.search_space)."""
    from meshplan.ingest import ingest
    from meshplan.runtime import local
    from meshplan.runtime.generic import search_space
    from meshplan.search import search
    from meshplan.spec.plan import Plan, Workload
    sys.path.insert(0, str(MODULES))
    old = local.cpu_tflops
    local.cpu_tflops = lambda seconds=0.2: 0.05  # a fixed CPU rate: the same winner on every machine
    try:
        cluster = local.local_cluster(2, "cpu")
        out = {}
        for fam, src in SOURCES.items():
            graph = ingest(src, seq_len=SEQ.get(fam))
            space = search_space(src, seq_len=SEQ.get(fam), base=Plan(precision="fp32"))
            result = search(graph, cluster, Workload(global_batch=BATCH, seq_len=graph.sample_tokens), space)
            assert result.plans, (fam, result.rejected)
            out[fam] = result.plans[0].plan.short()
        return out
    finally:
        local.cpu_tflops = old
        sys.path.remove(str(MODULES))


def case(name: str, fam: str, plan: str) -> dict:
    c = {"name": name, "source": SOURCES[fam], "plan": plan if "precision" in plan else plan + ",precision=fp32",
         "global_batch": BATCH, "steps": STEPS}
    if fam in SEQ:
        c["seq_len"] = SEQ[fam]
    return c


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, searched: dict[str, str]) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("ingested")
    cases = [case(f"{f}_searched", f, p) for f, p in searched.items()] + [case(n, f, p) for n, f, p in FORCED]
    out = torchrun_worker(tmp, 2, cases, WORKER, modules_env())
    out["__log__"][0]["plans"] = searched
    return out


VOCAB_TOLERANCE = {"losses": 1e-5, "norms": 5e-5}
"""Relative difference between tp=2 and one process (fp32, the same micro-batches), per step:
measured up to 2.1e-7 (losses) and 8.2e-6 (gradient norms, which sum squares over every tensor)."""


def _variant(tmp: Path, name: str, base: str, **fields: object) -> str:
    cfg = json.loads((HF / base).read_text())
    cfg.update(fields)
    (tmp / f"{name}.json").write_text(json.dumps(cfg))
    return f"hf:{tmp / f'{name}.json'}"


@pytest.fixture(scope="module")
def vocab_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """tp=2 (2 micro-batches) on causal and masked LMs with a vocabulary-parallel head and table:
    llama-tiny (untied), llama-tiny tied, tied with a vocabulary tp does not divide (1001: uneven
    shards), and BERT (tied decoder with its own bias alias, a padding row; dropout 0)."""
    tmp = tmp_path_factory.mktemp("vocab")
    sources = {"llama": SOURCES["llama"],
               "llama_tied": _variant(tmp, "llama-tied", "llama-tiny.json", tie_word_embeddings=True),
               "llama_tied_odd": _variant(tmp, "llama-tied-odd", "llama-tiny.json", tie_word_embeddings=True,
                                          vocab_size=1001),
               "bert": _variant(tmp, "bert-nodropout", "bert-tiny.json", hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0)}
    cases = [{"name": f"vocab_{k}", "kind": "vocab", "source": v, "plan": "tp=2,micro_batch=2,precision=fp32",
              "global_batch": BATCH, "steps": STEPS, "seq_len": 16} for k, v in sources.items()]
    return torchrun_worker(tmp, 2, cases, WORKER, modules_env())


@pytest.mark.parametrize("name", ["vocab_llama", "vocab_llama_tied", "vocab_llama_tied_odd", "vocab_bert"])
def test_tp_vocabulary_parallel_head(vocab_results: dict[str, list[dict]], name: str) -> None:
    """Under tp=2 the LM head is column-split with vocabulary-sharded logits (the loss under
    loss_parallel) and the embedding table row-split, both DTensors sharded on the vocabulary (a tied
    head is the table's parameter); losses equal one process within 1e-5, gradient norms 5e-5."""
    ranks = vocab_results[name]
    log = vocab_results["__log__"][0]
    assert len(ranks) == 2, f"{len(ranks)}/2 ranks reported; torchrun rc={log['rc']}\n{log['stderr']}"
    for r in ranks:
        assert r["ok"], f"rank {r['rank']}: {r.get('error')}\n{r.get('trace', '')[-2000:]}"
        assert r["vocab_parallel"] and r["head"] == "(Shard(dim=0),)" and r["table"] == "(Shard(dim=0),)", r
        assert r["tied"] == (name != "vocab_llama"), r
        if name == "vocab_bert":
            assert r["head_bias"] == "(Shard(dim=0),)", r  # the decoder's bias (and its alias) split too
        for what in ("losses", "norms"):
            for got, ref in zip(r[what], r[f"ref_{what}"]):
                assert abs(got - ref) <= VOCAB_TOLERANCE[what] * abs(ref), (name, what, r[what], r[f"ref_{what}"])
        assert not r["missing"] and max(r["weights_err"].values()) < 1e-3, (r["missing"], r["weights_err"])


def test_search_plans_use_two_processes(searched: dict[str, str]) -> None:
    from meshplan.spec.plan import parse_plan
    for fam, text in searched.items():
        plan = parse_plan(text)
        assert plan.num_gpus == 2 and plan.precision == "fp32", (fam, text)
    assert parse_plan(searched["t5"]).pp == 1  # search_space: T5 cannot be pipeline-split
    assert parse_plan(searched["cnn"]).tp == 1  # no attention/MLP matrices


@pytest.mark.parametrize("name", NAMES)
def test_matches_single_process(results: dict[str, list[dict]], name: str) -> None:
    ranks = results[name]
    log = results["__log__"][0]
    assert len(ranks) == 2, f"{len(ranks)}/2 ranks reported; torchrun rc={log['rc']}\n{log['stderr']}"
    for r in ranks:
        assert r["ok"], f"rank {r['rank']}: {r.get('error')}\n{r.get('trace', '')[-2000:]}"
        assert all(x == x and abs(x) < 1e4 for x in r["losses"]), r["losses"]  # finite
        # the reference is exact: no float32 op in it, and another order of it agrees to float64 rounding
        assert r["exact_fp32_ops"] == [] and r["exact_spread"] < EXACT_SPREAD, (r["exact_fp32_ops"], r["exact_spread"])
        check_errors(f"rank {r['rank']} losses", r["losses"], r["single_losses"], r["exact_losses"])
        check_errors(f"rank {r['rank']} gradient norms", r["norms"], r["single_norms"], r["exact_norms"])
        check_weights(r)
        assert r["noise_param_abs_err"] < 1e-2, r["rank"]
        assert not r["unknown_params"], r["unknown_params"]
    held = set().union(*(r["params"] for r in ranks))  # pipeline stages together hold every parameter
    assert held == set(ranks[0]["ref_params"])


def test_pipeline_stages_split_the_model(results: dict[str, list[dict]]) -> None:
    for name in ("llama_pp", "cnn_pp", "llama_pp_interleaved", "moe_pp"):
        a, b = (set(r["params"]) for r in results[name])
        assert a and b and not a & b, name  # each stage holds its own units only
    first = next(r for r in results["llama_pp"] if any("embed_tokens" in p for p in r["params"]))
    assert not any(p.startswith("lm_head") for p in first["params"])


def test_tp_notes(results: dict[str, list[dict]]) -> None:
    """Mixtral's fused experts stay whole under TP (attention is split) and the run says so."""
    notes = results["moe_searched"][0]["notes"]
    if "tp=2" in results["__log__"][0]["plans"]["moe"]:
        assert any("gate_up_proj is fused" in n for n in notes), notes


def test_meshplan_train_cli(tmp_path: Path) -> None:
    """`meshplan train --model hf:...` on 2 processes (pipeline): per-step metrics and the graph
    cost model's estimate beside the measurement."""
    m = tmp_path / "m.jsonl"
    p = meshplan_train("--model", SOURCES["llama"], "--plan", "pp=2,micro_batch=1,precision=fp32",
                       "--global-batch", "4", "--steps", "3", "--seq-len", "32", "--metrics", str(m),
                       "--pg-timeout", "60", env=modules_env())
    assert p.returncode == 0, p.stderr[-4000:]
    rows = [json.loads(x) for x in m.read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["step_time_s"] > 0 and r["tokens_per_s"] > 0 for r in steps)
    summary = rows[-1]
    assert summary["kind"] == "summary" and summary["world_size"] == 2 and summary["sample_tokens"] == 32
    assert summary["measured"]["step_time_s"] > 0
    assert summary["estimate"]["step_time_s"] > 0 and summary["estimate"]["activations_gib"] > 0, summary
    assert "estimated" in p.stdout and "measured" in p.stdout


def test_preflight_refuses_once_before_any_rank_starts() -> None:
    """`meshplan train` on an ingested model with a dp-only plan: a --seq-len past GPT-2's learned
    positions and a run far beyond any host's memory are one line from the launcher (the ranks,
    which used to say it once each, never start)."""
    env = modules_env()
    for argv, needle in (
            (["--model", f"hf:{HF / 'gpt2-tiny.json'}", "--seq-len", "256"], "seq_len 256 exceeds the model's 128"),
            (["--model", SOURCES["llama"], "--seq-len", "16777216"], "not enough host memory for llama-tiny")):
        p = meshplan_train(*argv, "--plan", "dp=2,precision=fp32", "--global-batch", "4", "--steps", "1", env=env)
        lines = [x for x in p.stderr.splitlines() if x.strip()]
        assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
        assert lines[0].startswith("meshplan: error: ") and needle in lines[0], lines[0]


def test_ddp_without_the_unused_parameters_warning_and_a_killed_rank() -> None:
    """DDP (ViT, zero=0) with Python's default warning filters: find_unused_parameters is off for a
    model whose parameters all get gradients (so DDP has nothing to warn about). Then rank 1 killed
    by SIGKILL after a step: one line from the launcher, with the pre-flight estimate."""
    common = ["--model", SOURCES["vit"], "--plan", "dp=2,zero=0,precision=fp32", "--global-batch", "4",
              "--pg-timeout", "60"]
    p = meshplan_train(*common, "--steps", "2", env=run_env(PYTHONPATH=f"{MODULES}:{ROOT / 'src'}",
                                                            PYTHONWARNINGS="default"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "find_unused_parameters" not in p.stderr, p.stderr[-3000:]
    p = meshplan_train(*common, "--steps", "3", env=run_env(PYTHONPATH=f"{MODULES}:{ROOT / 'src'}",
                                                            MESHPLAN_FAIL_AT="1:1:SIGKILL"))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    last = [x for x in p.stderr.splitlines() if x.startswith("meshplan: error:")][-1]
    assert last.startswith("meshplan: error: training failed: rank 1 was killed (SIGKILL"), last
    assert "most likely out of host memory" in last and "the cost model estimated" in last, last


def test_units_in_execution_order_are_the_graph_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime's units in execution order are the graph's layers (the same number, in the same order):
    spec.stages.stage_layer_ranges indexes both."""
    from meshplan.ingest import build, ingest
    from meshplan.runtime.generic import execution_order, make_batch, unit_paths
    monkeypatch.syspath_prepend(str(MODULES))
    for fam, src in SOURCES.items():
        built = build(src, device="cpu", seq_len=SEQ.get(fam))
        order = execution_order(built.module, unit_paths(built.module)[0], make_batch(built, 1, 0))
        graph = ingest(src, seq_len=SEQ.get(fam))
        assert [u.name for u in order] == [x.name for x in graph.layers], fam


def test_pipeline_refuses_a_forward_that_is_not_a_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """A skip connection over the blocks: cutting the forward at a stage boundary changes it."""
    from meshplan.errors import MeshplanError
    from meshplan.ingest import build
    from meshplan.runtime.generic import check_sequence, execution_order, make_batch, stage_bounds, unit_paths
    from meshplan.spec.plan import Plan
    monkeypatch.syspath_prepend(str(MODULES))
    built = build("module:skip_net:make_skip_net", device="cpu")
    sample = make_batch(built, 1, 0)
    order = execution_order(built.module, unit_paths(built.module)[0], sample)
    assert [u.name for u in order] == ["stem", "blocks.0", "blocks.1", "blocks.2", "head"]
    # stages count blocks: the stem goes with the first, the head with the last
    assert stage_bounds(order, Plan(pp=2)) == [(0, 3), (3, 5)]
    assert stage_bounds(order, Plan(pp=3)) == [(0, 2), (2, 3), (3, 5)]
    with pytest.raises(MeshplanError, match="changes its output"):
        check_sequence(built, order, stage_bounds(order, Plan(pp=2)), sample)
    llama = build(SOURCES["llama"], device="cpu", seq_len=8)  # and a sequence passes, at every cut
    sample = make_batch(llama, 1, 0)
    order = execution_order(llama.module, unit_paths(llama.module)[0], sample)
    check_sequence(llama, order, [(i, i + 1) for i in range(len(order))], sample)


@pytest.mark.parametrize("argv,message", [
    (["--model", SOURCES["t5"], "--plan", "pp=2,precision=fp32"], "encoder-decoder"),
    (["--model", f"hf:{HF / 'gpt2-tiny.json'}", "--plan", "pp=2,precision=fp32"], "ties weights across units"),
    (["--model", f"hf:{HF / 'gpt2-tiny.json'}", "--plan", "tp=2,precision=fp32"],  # its c_attn is fused
     "no layer of the model has linear layers tensor parallelism can split"),
    (["--model", SOURCES["llama"], "--plan", "tp=2,sequence_parallel=1,precision=fp32"],
     "sequence parallelism to the transformers it builds"),
    (["--model", SOURCES["cnn"], "--plan", "tp=2,precision=fp32"],
     "no layer of the model has linear layers tensor parallelism can split"),
    (["--model", SOURCES["llama"], "--plan", "cp=2,precision=fp32"], "cp=2 on a traced model"),
    (["--model", SOURCES["llama"], "--plan", "dp=2,precision=fp32", "--data", "corpus"], "synthetic batches"),
    (["--model", SOURCES["llama"], "--plan", "pp=2,stage_layers=1:2,precision=fp32"],
     "stage_layers sum to 3 but the model has 4"),
    (["--model", SOURCES["llama"], "--plan", "dp=2,micro_batch=3,precision=fp32"], "not divisible"),
])
def test_refusals(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans the runtime cannot run on a model: one line, exit 2, before any process starts
    (in this process: the checks build the model on the meta device)."""
    from meshplan.cli.main import main
    monkeypatch.syspath_prepend(str(MODULES))
    rc = main(["train", *argv, "--global-batch", "4", "--steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("meshplan: error:") and message in err[0], err
