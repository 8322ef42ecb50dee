"""The 2026-12-08 fresh-clone review's findings, each with a test that fails before its fix."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from meshplan.cli.main import main


class _ClosedPipe:
    """stdout of `meshplan plan ... | head -3` once head has exited: every write is a broken pipe."""

    def write(self, s: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_plan_out_is_written_even_when_the_reader_closes_the_pipe(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    with contextlib.redirect_stdout(_ClosedPipe()):
        rc = main(["plan", "--model", "gpt2-medium", "--cluster", "h100-sxm-80gb:8", "--global-batch", "32",
                   "--seq-len", "1024", "--out", str(out)])
    assert rc == 0
    assert out.is_file() and json.loads(out.read_text())["plan"]


def test_a_plan_naming_a_pool_the_cluster_has_not_is_refused(capsys) -> None:
    rc = main(["estimate", "--model", "gpt2-medium", "--cluster", "h100-sxm-80gb:8", "--global-batch", "32",
               "--seq-len", "1024", "--plan", "dp=8,pools=a100"])
    err = capsys.readouterr().err
    assert rc == 2 and "no pool named 'a100'" in err and len(err.strip().splitlines()) == 1


def test_a_negative_sequence_length_is_called_what_it_is(capsys) -> None:
    rc = main(["estimate", "--model", "gpt2-medium", "--cluster", "h100-sxm-80gb:8", "--global-batch", "32",
               "--seq-len", "-5", "--plan", "dp=8"])
    err = capsys.readouterr().err
    assert rc == 2 and "positive" in err and "length:probability" not in err.splitlines()[0].split("(")[0]


def test_experts_held_by_one_rank_of_their_group_are_not_charged_zero1_fp32_gradients() -> None:
    """Found by test_invariants' hypothesis on 2026-12-08: with ep = dp the experts have one replica, so ZeRO-1
    shards nothing of them, yet they were charged ZeRO-1's fp32 gradients (4 B, not ZeRO-0's 2 B): a higher ZeRO
    level needed more memory. A part whose own group is one rank now takes ZeRO-0's bytes, as a plan with dp = 1."""
    from meshplan.cost import estimate
    from meshplan.spec.io import load_cluster
    from meshplan.spec.model import ModelSpec
    from meshplan.spec.plan import Plan, Workload
    model = ModelSpec(name="moe", num_layers=14, hidden_size=512, num_attention_heads=8, num_kv_heads=2,
                      ffn_hidden_size=2048, vocab_size=1000, seq_len=1024, num_experts=16, experts_per_token=2,
                      expert_ffn_hidden_size=4096)
    cluster, work = load_cluster("h100-sxm-80gb:16"), Workload(global_batch=4, seq_len=1024)
    states = {}
    for z in (0, 1):  # dp = ep = 4: each expert has one replica
        r = estimate(model, cluster, Plan(tp=2, pp=2, dp=4, ep=4, zero=z), work)
        states[z] = r.memory["weights"] + r.memory["grads"] + r.memory["optimizer"]
    assert states[1] <= states[0] * (1 + 1e-9), states
