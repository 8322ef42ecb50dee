"""`meshplan train --metrics` files -> calibration cases (calibration.metrics.cases_from_metrics).

The samples in tests/data/metrics were written by the runtime on CPU (2 processes, fp32):
``tiny-llama-switch.jsonl``: `meshplan train --model tiny-llama --global-batch 8 --seq-len 32 --plan
tp=2,micro_batch=1,precision=fp32 --steps 5 --replan-after 3 --switch --checkpoint-dir ck --metrics ...`
(two summaries: the part under tp=2 ended by the switch, and the rest under the plan it switched to);
``llama-tiny-hf-fsdp.jsonl``: an ingested model (`hf:tests/data/hf/llama-tiny.json`, dp=2 zero=3, 3
steps), whose summary records its traced LayerGraph."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.calibration.metrics import cases_from_metrics
from meshplan.errors import MeshplanError
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"
SWITCH = DATA / "tiny-llama-switch.jsonl"
INGESTED = DATA / "llama-tiny-hf-fsdp.jsonl"


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_one_case_per_summary() -> None:
    cases = cases_from_metrics([str(SWITCH), str(INGESTED)])
    summaries = [r for p in (SWITCH, INGESTED) for r in records(p) if r.get("kind") == "summary"]
    assert len(cases) == len(summaries) == 3
    for c, s in zip(cases, summaries):
        assert c.ok, c.reason
        assert c.plan.short() == s["plan_as_run"]
        assert c.work.global_batch == s["global_batch"] and c.work.seq_len == s["seq_len"]
        assert c.measured_step_time_s == s["measured"]["step_time_s"]
        assert c.measured_peak_mem_gib == s["measured"]["peak_memory_gib"]
        assert c.measured_fits is True and c.memory_by_nvidia_smi is False
        assert c.profile == "meshplan" and c.overrides == {}
        assert c.cluster.name == s["cluster_spec"]["name"] == "local-cpu:2"
        assert c.cluster.gpu.peak_tflops["fp32"] == s["cluster_spec"]["gpu"]["peak_tflops"]["fp32"]
        assert "median step time" in c.measured_from
    assert [c.source_id for c in cases] == [str(SWITCH)] * 2 + [str(INGESTED)]
    assert isinstance(cases[0].model, ModelSpec) and cases[0].model.name == "tiny-llama"
    assert isinstance(cases[2].model, LayerGraph) and cases[2].model_name == "llama-tiny"
    assert cases[0].plan.tp == 2 and cases[1].plan.dp == 2  # before and after the switch
    assert "median step time of steps 2-3 (step 1, the first, is warm-up)" in cases[0].measured_from


def test_cases_are_fitted_like_published_runs() -> None:
    """runs_from_cases keeps them (measured, within the planner's constraints), and the fit moves the
    prediction of their step times towards the measurement."""
    from meshplan.calibration.fit import fit, runs_from_cases, step_mape
    from meshplan.calibration.store import builtin
    runs = runs_from_cases(cases_from_metrics([str(SWITCH), str(INGESTED)]))
    assert len(runs) == 3
    before = step_mape(runs, builtin().values)
    values, results = fit(runs, None, prior="builtin", from_prior=False, max_iter=10)
    after = step_mape(runs, values)
    assert {r.rows for r in results} == {3}
    assert before is not None and after is not None and after < before


def test_summary_without_specs_is_unsupported(tmp_path: Path) -> None:
    """A summary written before the runtime recorded the run's specs: a case with the reason (nothing
    dropped silently), which the fit leaves out."""
    from meshplan.calibration.fit import runs_from_cases
    old = [r for r in records(SWITCH) if r.get("kind") == "summary"][0]
    old = {k: v for k, v in old.items() if k not in ("model_spec", "cluster_spec", "global_batch", "seq_len")}
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n" + json.dumps(old) + "\n")
    (case,) = cases_from_metrics([str(path)])
    assert not case.ok and case.model_name == "tiny-llama"
    assert "no model_spec, cluster_spec, global_batch, seq_len" in case.reason and "run it again" in case.reason
    assert len(runs_from_cases([case])) == 0


def test_no_summary_no_case(tmp_path: Path) -> None:
    path = tmp_path / "crashed.jsonl"
    path.write_text("".join(x + "\n" for x in SWITCH.read_text().splitlines()[:3]))  # steps only
    assert cases_from_metrics([str(path)]) == []


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(MeshplanError, match="no such file"):
        cases_from_metrics([str(tmp_path / "missing.jsonl")])
    with pytest.raises(MeshplanError, match="is a directory"):
        cases_from_metrics([str(tmp_path)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\n{"kind": "summary"\n')
    with pytest.raises(MeshplanError, match="line 2: not JSON"):
        cases_from_metrics([str(bad)])
    bad.write_text('[1, 2]\n')
    with pytest.raises(MeshplanError, match="line 1: not a JSON object"):
        cases_from_metrics([str(bad)])


def test_bad_summary_is_unsupported_not_a_crash(tmp_path: Path) -> None:
    s = [r for r in records(SWITCH) if r.get("kind") == "summary"][0]
    path = tmp_path / "m.jsonl"
    for broken, words in ((dict(s, plan_as_run="tp=x"), "tp"), (dict(s, global_batch="8"), "whole numbers"),
                          (dict(s, cluster_spec={"name": "c"}), "gpu"), (dict(s, measured={}), "no step")):
        path.write_text(json.dumps(broken) + "\n")
        (case,) = cases_from_metrics([str(path)])
        assert not case.ok and words in case.reason, case.reason


def test_no_torch() -> None:
    code = ("import sys; from meshplan.calibration.metrics import cases_from_metrics; "
            f"cases_from_metrics([{str(SWITCH)!r}, {str(INGESTED)!r}]); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_calibrate_cli_takes_metrics_alone_and_with_runs(tmp_path, capsys):
    """`meshplan calibrate --metrics FILE` fits to the run's measured steps; with --runs the two mix."""
    from meshplan.calibration.store import load_calibration
    from meshplan.cli.main import main
    out = tmp_path / "m.json"
    assert main(["calibrate", "--metrics", str(INGESTED), "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fitted_from"]["metrics"] and doc["fitted_from"]["rows"] == 1
    assert load_calibration(str(out)).values
    runs = tmp_path / "few.csv"
    dev = Path(__file__).resolve().parents[2] / "src" / "meshplan" / "data" / "published_runs_dev.csv"
    lines = dev.read_text().splitlines(keepends=True)
    runs.write_text("".join(lines[:1] + [x for x in lines[1:] if x.startswith(("77,", "78,"))]))
    assert main(["calibrate", "--metrics", str(INGESTED), "--runs", str(runs), "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fitted_from"]["rows"] == 3 and len(doc["fitted_from"]["sources"]) == 2
