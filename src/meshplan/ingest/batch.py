"""A synthetic training batch and the default losses (torch)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class Batch:
    """One micro-batch: ``module(*args, **kwargs)`` gives the outputs, ``loss_fn(outputs, batch)`` the loss.

    ``targets`` holds the labels (token ids, class ids) or whatever a module: source's loss wants;
    ``raw`` is what a module: source's ``example_inputs`` returned (None for hf: sources)."""

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    targets: Any = None
    raw: Any = None

    def to(self, device: str | torch.device) -> Batch:
        mv = _mover(device)
        return Batch(args=mv(self.args), kwargs=mv(self.kwargs), targets=mv(self.targets), raw=mv(self.raw))


def _mover(device: str | torch.device):
    from torch.utils._pytree import tree_map

    return lambda x: tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, x)


def class_logits(outputs: Any) -> torch.Tensor:
    """The logits of a model output: ``.logits``, the first element of a tuple, or the tensor itself."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    if isinstance(outputs, dict) and isinstance(outputs.get("logits"), torch.Tensor):
        return outputs["logits"]
    raise TypeError(f"cannot find logits in a {type(outputs).__name__}")


def token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens, in float32 (logits [..., V], targets [...])."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def default_loss(outputs: Any, batch: Batch) -> torch.Tensor:
    """Loss of a module: source without its own ``loss``: cross-entropy against synthetic labels
    (class 0 ... the label is irrelevant to the cost) when the output looks like logits
    ([batch, classes] or [batch, seq, vocab]), else the mean square of the output."""
    out = class_logits(outputs)
    if out.is_floating_point() and out.dim() in (2, 3):
        labels = torch.zeros(out.shape[:-1], dtype=torch.long, device=out.device)
        return token_ce(out, labels)
    return out.float().square().mean()
