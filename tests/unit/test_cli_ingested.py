"""estimate / plan / ingest on ingested models (hf: configs), through the command line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.cli.main import main

pytest.importorskip("torch")
pytest.importorskip("transformers")

HF = Path(__file__).resolve().parents[1] / "data" / "hf"


@pytest.fixture(scope="module")
def graph_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("graph") / "llama.json"
    assert main(["ingest", "--model", f"hf:{HF / 'llama-tiny.json'}", "--out", str(out)]) == 0
    return out


def test_ingest_writes_a_graph_that_plans_without_tracing_again(graph_file: Path, capsys) -> None:
    doc = json.loads(graph_file.read_text())
    assert doc["source"].startswith("hf:") and len(doc["layers"]) >= 3
    capsys.readouterr()
    assert main(["plan", "--model", str(graph_file), "--cluster", "a100-sxm-80gb:8", "--global-batch", "32",
                 "--json", "--top", "3"]) == 0
    res = json.loads(capsys.readouterr().out)
    best = res["plans"][0]
    assert best["cost"]["fits"] and best["cost"]["step_time_s"] > 0
    # the winner, estimated on its own, gives the same step time
    plan = best["plan"]
    plan_str = best["short"]
    assert main(["estimate", "--model", str(graph_file), "--cluster", "a100-sxm-80gb:8", "--plan", plan_str,
                 "--global-batch", "32", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    if not plan.get("stage_layers") and plan.get("schedule", "1f1b") == "1f1b" and plan.get("recompute") == "none":
        assert est["step_time_s"] == pytest.approx(best["cost"]["step_time_s"], rel=1e-6)


def test_estimate_and_plan_accept_hf_sources_directly(capsys) -> None:
    src = f"hf:{HF / 'llama-tiny.json'}"
    assert main(["estimate", "--model", src, "--cluster", "a100-sxm-80gb:8", "--plan", "dp=4,tp=2,zero=3",
                 "--global-batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "ingested layer graph" in out and "step time" in out
    assert main(["plan", "--model", src, "--cluster", "a100-sxm-80gb:8", "--global-batch", "16",
                 "--fix", "tp=2", "--top", "2"]) == 0
    assert "tp=2" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["estimate", "--cluster", "a100-sxm-80gb:8", "--plan", "dp=8", "--global-batch", "8", "--seq-len", "7"],
     "traced at"),
    (["estimate", "--cluster", "a100-sxm-80gb:8", "--plan", "dp=4,ep=2", "--global-batch", "8"], "no experts"),
])
def test_graph_errors_are_one_line(graph_file: Path, capsys, argv: list[str], needle: str) -> None:
    argv = argv[:1] + ["--model", str(graph_file)] + argv[1:]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshplan: error:") and needle in err and "\n" not in err


def test_an_ingested_model_is_priced_over_the_whole_space_and_planned_for_its_runtime(graph_file: Path, capsys):
    """The cost model prices context and sequence parallelism on the attention and norms ingestion
    found; meshplan's runtime does not run them on a traced model, so the search does not
    recommend them, and a request that fixes one says why in one line (spec.support)."""
    assert main(["estimate", "--model", str(graph_file), "--cluster", "a100-sxm-80gb:8", "--plan",
                 "tp=2,dp=2,cp=2,sequence_parallel=1", "--global-batch", "8", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["step_time_s"] > 0 and est["fits"] and not est["runtime"]["runs_as_planned"]
    assert {i["rule"] for i in est["runtime"]["issues"]} == {"context parallel on a traced model",
                                                              "sequence parallel on a traced model"}
    assert main(["plan", "--model", str(graph_file), "--cluster", "a100-sxm-80gb:8", "--global-batch", "8",
                 "--fix", "cp=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--fix cp" in err and "context parallelism on the transformers it builds" in err and "\n" not in err
    assert main(["plan", "--model", str(graph_file), "--cluster", "a100-sxm-80gb:8", "--global-batch", "8",
                 "--fix", "tp=2", "--json", "--top", "3"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["plans"] and all(not p["plan"].get("sequence_parallel") for p in res["plans"])


def test_ingest_rejects_presets_and_bad_sources(capsys) -> None:
    assert main(["ingest", "--model", "llama3-8b"]) == 2
    assert "hf:CONFIG.json" in capsys.readouterr().err
    assert main(["ingest", "--model", "hf:/nonexistent/config.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshplan: error:") and "Traceback" not in err
