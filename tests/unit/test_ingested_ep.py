"""Expert parallelism for ingested MoE models (issue 29): the support table no longer refuses ep>1
on a traced model, the graph cost model divides fused experts' parameters by ep (``params_ep``),
the runtime's search space enumerates ep for models with experts it splits, and on 64 H100 the
search recommends an ep>1 plan for ingested Mixtral-8x7B and DeepSeek-V2-Lite configs. The
runtime side (parity with one process) is tests/dist/test_ingested_ep_runtime.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.cli.main import main

pytest.importorskip("torch")
pytest.importorskip("transformers")

HF = Path(__file__).resolve().parents[1] / "data" / "hf"
MODULES = Path(__file__).resolve().parents[1] / "data" / "modules"


@pytest.fixture(scope="module")
def mixtral_tiny():  # noqa: ANN201
    from meshplan.ingest import ingest
    return ingest(f"hf:{HF / 'mixtral-tiny.json'}", seq_len=32)


def test_ep_on_a_traced_model_breaks_no_runtime_rule(mixtral_tiny) -> None:  # noqa: ANN001
    from meshplan.spec.plan import Plan
    from meshplan.spec.support import RULES, TRACED, runtime_violations, traced_refusal
    plan = Plan(dp=4, ep=2)
    assert traced_refusal(plan) is None
    assert runtime_violations(plan, 2, mixtral_tiny) == []
    assert not any("expert" in n and "traced" in n for n in RULES) and len(TRACED) == 4


def test_vectorised_runtime_checks_accept_ep_on_traced_models(mixtral_tiny) -> None:  # noqa: ANN001
    import numpy as np

    from meshplan.search.columns import PlanColumns
    from meshplan.search.constraints import RUNTIME_CHECKS
    from meshplan.spec.io import load_cluster
    from meshplan.spec.plan import Plan, Workload
    cols = PlanColumns.from_plans([Plan(dp=4, ep=2), Plan(dp=4, ep=4)])
    c = load_cluster("h100-sxm-80gb:4")
    w = Workload(global_batch=8, seq_len=32)
    for name, mask in RUNTIME_CHECKS.items():
        assert not np.asarray(mask(mixtral_tiny, c, w, cols)).any(), name


def test_fused_experts_are_divided_by_ep_not_tp(mixtral_tiny) -> None:  # noqa: ANN001
    """Mixtral's fused experts (4 x 3 x 128 x 256 per layer) stay whole under TP and ep divides them:
    the per-GPU parameters drop by exactly half of them at ep=2, not at tp=2's split."""
    from meshplan.cost.batch import layout, local_params
    import numpy as np
    ops = mixtral_tiny.ops["MixtralDecoderLayer"]
    assert ops.params_ep == 4 * 3 * 128 * 256 and ops.params_expert == 0
    lay = layout(mixtral_tiny)
    b = lay.ids.index("MixtralDecoderLayer")
    one, two = (local_params(lay, np.array([1.0]), np.array([e]))[0, b] for e in (1.0, 2.0))
    assert one - two == pytest.approx(ops.params_ep / 2)
    tp2 = local_params(lay, np.array([2.0]), np.array([1.0]))[0, b]
    assert one - tp2 == pytest.approx(ops.params_split / 2)  # TP splits only attention (and the router not)


def test_estimate_prices_ep_all_to_all_and_less_memory(capsys) -> None:
    def est(config: str, ep: int) -> dict:
        assert main(["estimate", "--model", f"hf:{HF / config}", "--cluster", "h100-sxm-80gb:64", "--global-batch",
                     "256", "--seq-len", "4096", "--json", "--plan", f"dp=64,ep={ep},zero=2,micro_batch=1"]) == 0
        return json.loads(capsys.readouterr().out)
    out = {1: est("mixtral-8x7b.json", 1), 8: est("mixtral-8x7b.json", 8)}
    assert out[8]["runtime"]["runs_as_planned"]
    assert out[8]["peak_memory_gib"] < out[1]["peak_memory_gib"] - 10  # 7/8 of ~45B expert params gone
    assert out[1]["time"]["ep_comm"] == 0.0 and out[8]["time"]["ep_comm"] > 0.0
    # the placement's links (DeepSeek-V2-Lite, 64 experts): ep=8 stays in an 8-GPU NVLink node, ep=16
    # crosses the network; the bytes grow only by (15/16) / (7/8) = 1.07
    in_node, across = est("deepseek-v2-lite.json", 8), est("deepseek-v2-lite.json", 16)
    assert across["runtime"]["runs_as_planned"]
    assert across["time"]["ep_comm"] > 1.3 * in_node["time"]["ep_comm"] > 0


def test_search_space_enumerates_ep_for_moe_sources() -> None:
    import sys
    from meshplan.runtime.generic import search_space
    assert search_space(f"hf:{HF / 'mixtral-tiny.json'}", seq_len=16).ep is None  # the search's divisors
    assert search_space(f"hf:{HF / 'llama-tiny.json'}", seq_len=16).ep == (1,)
    sys.path.insert(0, str(MODULES))
    try:
        assert search_space("module:list_moe:make_list_moe", seq_len=16).ep is None
    finally:
        sys.path.remove(str(MODULES))


@pytest.mark.parametrize("config", ["mixtral-8x7b.json", "deepseek-v2-lite.json"])
def test_plan_recommends_ep_on_64_h100(config: str, capsys) -> None:
    """The done-when: on 64 H100 an ingested Mixtral-8x7B and DeepSeek-V2-Lite get an ep>1 plan."""
    assert main(["plan", "--model", f"hf:{HF / config}", "--cluster", "h100-sxm-80gb:64", "--global-batch", "256",
                 "--seq-len", "4096", "--json", "--top", "3"]) == 0
    res = json.loads(capsys.readouterr().out)
    best = res["plans"][0]
    assert best["plan"].get("ep", 1) > 1, best["plan"]
    assert not best["export_only"]  # meshplan's runtime runs it
