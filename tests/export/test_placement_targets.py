"""The placement (plan field mesh_order) in the torchtitan and DeepSpeed exports: both lay out the
ranks in one fixed order (pp outermost, tp innermost: meshplan's default), so a plan with another
placement exports with an unsupported line, and one whose placement moves only axes of degree 1
(the same rank layout as the default) exports without one. Megatron-LM, which has a second order,
is checked against megatron-core in test_megatron.py."""
from __future__ import annotations

import pytest

from meshplan.export import ExportInput, export, render
from meshplan.spec.io import load_model
from meshplan.spec.plan import parse_plan


@pytest.mark.parametrize("target", ["torchtitan", "deepspeed"])
@pytest.mark.parametrize("plan,moved", [
    ("tp=2,pp=2,dp=2", False),
    ("tp=2,pp=2,dp=2,mesh_order=pp:cp:dp:tp", False),  # cp=1: the default layout
    ("tp=1,pp=2,dp=4,mesh_order=pp:tp:dp:cp", False),
    ("tp=2,pp=2,dp=2,mesh_order=dp:pp:cp:tp", True),
    ("tp=2,pp=1,dp=4,mesh_order=tp:dp:pp:cp", True),
])
def test_fixed_order_targets_name_a_moved_placement(target: str, plan: str, moved: bool) -> None:
    p = parse_plan(plan)
    res = export(target, ExportInput(plan=p, model=load_model("llama3-8b"), global_batch=64, seq_len=4096))
    lines = [u for u in res.unsupported if u.startswith("mesh_order=")]
    assert len(lines) == int(moved), res.unsupported
    if moved:
        assert lines[0].startswith(f"mesh_order={':'.join(p.dims.order)}:") and "pp:dp:cp:tp" in lines[0]
        assert "mesh_order=" in render(res)  # written into the file too
