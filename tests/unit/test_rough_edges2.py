"""Issue 29: the remaining rough edges and the honest refusals, each with a test that failed before its fix."""
from __future__ import annotations

import json

import pytest

from clirun import run


def test_no_plan_fits_names_memory_not_a_size_tried_while_growing(capsys):
    """Item 3: on 16 V100s with pp=16 GPipe fixed, the refusal was "no mesh ... makes 24 GPUs" (a
    size the search for a larger cluster tried), not that no pp=16 GPipe plan fits in memory."""
    rc, _, err = run(capsys, "plan", "--model", "megatron-39b", "--cluster", "v100-sxm-32gb:16",
                     "--global-batch", "64", "--fix", "pp=16,schedule=gpipe")
    assert rc == 3, err
    line = err.strip().splitlines()[-1]
    assert "no mesh" not in line
    assert "no plan fits megatron-39b on 16 x v100-sxm-32gb" in line
    assert "the most memory-saving plan (tp=1,pp=16,dp=1" in line and "needs 33.5 GiB per GPU of 30.1 usable" in line
    assert "needs at least 32 x v100-sxm-32gb" in line
