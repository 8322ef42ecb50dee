"""meshplan's runtime runs adamw, sgd and adafactor (torch's own), and the optimizer-state bytes per
parameter it measures (the tensors of optimizer.state_dict()['state'] over the parameters it
updates) equal the cost model's, for the models it trains (issue 27 item 3). One process on CPU.

The per-tensor ``step`` counters (0-dimensional, 4 B per parameter tensor, not per parameter) are
left out on both sides (cost.memory.OPTIMIZER_STATE_BYTES).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from meshplan.cost import estimate  # noqa: E402
from meshplan.cost.memory import optimizer_cost  # noqa: E402
from meshplan.errors import MeshplanError  # noqa: E402
from meshplan.runtime.run_config import RunConfig  # noqa: E402
from meshplan.runtime.train import Trainer, make_optimizer  # noqa: E402
from meshplan.spec.io import load_model, parse_cluster_shorthand  # noqa: E402
from meshplan.spec.plan import RUNTIME_OPTIMIZERS, Plan, Workload  # noqa: E402
from meshplan.spec.transformer import as_graph  # noqa: E402
from meshplan.units import GiB  # noqa: E402


def measured_state_bytes_per_param(trainer: Trainer) -> float:
    """Sum of the optimizer states' tensor bytes (0-dim step counters left out) per parameter."""
    nbytes = sum(t.numel() * t.element_size() for opt in trainer.optimizers
                 for st in opt.state_dict()["state"].values() for t in st.values()
                 if torch.is_tensor(t) and t.dim() > 0)
    params = sum(p.numel() for part in trainer.par.parts for p in part.parameters())
    return nbytes / params


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-moe"])
@pytest.mark.parametrize("opt", RUNTIME_OPTIMIZERS)
def test_measured_optimizer_state_bytes_equal_the_cost_models(name, opt):
    spec = load_model(name)
    cfg = RunConfig(model=spec, plan=Plan(micro_batch=2, precision="fp32"), global_batch=2, steps=1,
                    optimizer=opt)
    trainer = Trainer(cfg, None, torch.device("cpu"))
    loss = trainer.train_step()
    assert loss == loss  # a finite step ran
    kind = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "adafactor": torch.optim.Adafactor}[opt]
    assert all(type(o) is kind for o in trainer.optimizers)
    graph = as_graph(spec, spec.seq_len)
    want = optimizer_cost(opt, graph).state_bytes
    assert measured_state_bytes_per_param(trainer) == want
    # the same figure in the estimate of this run (one GPU, fp32: no master copy)
    r = estimate(spec, parse_cluster_shorthand("a100-sxm-80gb:1"), cfg.plan,
                 Workload(global_batch=2, seq_len=spec.seq_len, optimizer=opt))
    assert r.memory["optimizer"] * GiB == pytest.approx(want * spec.num_params(), rel=1e-12)


def test_the_runtime_refuses_an_optimizer_it_does_not_run():
    cfg = RunConfig(model=load_model("tiny-llama"), plan=Plan(), global_batch=1, steps=1, optimizer="lion")
    with pytest.raises(MeshplanError, match="runs adamw, sgd, adafactor only"):
        make_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2))])
