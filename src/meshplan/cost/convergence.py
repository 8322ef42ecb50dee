"""Token efficiency: how many more tokens a synchronisation method needs to reach the loss that
fully synchronous training reaches (1.0 = the same; 1.1 = 10% more tokens).

A plan's time to a target loss is its step time x this factor (every plan trains the same
global batch per step). The step-time model says what a method saves per step; this says what
it costs in convergence. The defaults below are the published results they cite, and beyond
the published regime an explicit, labelled assumption; `meshplan plan --token-efficiency FILE`
replaces any of them (a TOML file of the same tables, see ``DEFAULTS`` and docs/weak-links.md).

The factor of a plan is the product of its method's factor (DiLoCo, local SGD: by the number
of outer workers M and the sync period H) and its compression's (bf16, fp8, PowerSGD by rank).
Pure Python + numpy: the search evaluates it for many plans at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplan.errors import MeshplanError

DEFAULTS: dict[str, dict[str, Any]] = {
    "diloco": {
        "factor": 1.0, "max_workers": 8, "max_sync_every": 500, "per_doubling": 0.03,
        "source": "Douillard et al. 2023, DiLoCo (arXiv 2311.08105): on C4, 8 workers with H = 500 inner "
                  "steps perform as well as fully synchronous optimization while communicating 500x less. "
                  "Beyond 8 workers or H = 500: +3% tokens per doubling of either (meshplan's assumption, "
                  "not a published figure)",
    },
    "local-sgd": {
        "factor": 1.0, "max_workers": 8, "max_sync_every": 1, "per_doubling": 0.05,
        "source": "Local SGD (model averaging every H steps, outer learning rate 1) is data parallel at "
                  "H = 1; DiLoCo's ablations (Douillard et al. 2023) find plain averaging worse than a "
                  "Nesterov outer step at large H. +5% tokens per doubling of H and of workers beyond 8 "
                  "(meshplan's assumption, not a published figure)",
    },
    "compression": {
        "none": 1.0, "bf16": 1.0, "fp8": 1.0,
        "source": "FP8-LM (Peng et al. 2023, arXiv 2310.18313): GPT models up to 175B trained with FP8 "
                  "gradients and FP8 all-reduce (with automatic scaling) match the BF16 loss curves; bf16, "
                  "which keeps more bits, is taken as lossless too",
    },
    "powersgd": {
        "1": 1.15, "2": 1.05, "4": 1.0,
        "source": "Vogels et al. 2019, PowerSGD (NeurIPS): rank 2 reaches the full-precision test accuracy "
                  "of ResNet-18 on CIFAR-10 (94.4% vs 94.3%) and rank 4 matches an LSTM on WikiText-2 in the "
                  "same epochs; rank 1 falls short (93.6%). Ranks above 4: as rank 4; ranks between: the "
                  "next lower rank's factor. rank 1 = 1.15 and rank 2 = 1.05 for transformer pre-training "
                  "are meshplan's translation of those gaps, not published token counts",
    },
}
"""Every default, with its source. Keys of an override file replace these (per table)."""

METHODS = ("diloco", "local-sgd")


@dataclass(frozen=True)
class TokenEfficiency:
    """The factors in force: DEFAULTS with a user's overrides, and where they came from."""

    tables: dict[str, dict[str, Any]] = field(default_factory=lambda: {k: dict(v) for k, v in DEFAULTS.items()})
    origin: str = "built-in defaults (meshplan.cost.convergence.DEFAULTS)"

    def method_factor(self, grad_sync: Any, sync_every: Any, workers: Any) -> np.ndarray:
        """Tokens relative to synchronous training of each row's method (1 for synchronous ones)
        with ``workers`` outer workers (inner groups) and sync period ``sync_every``."""
        gs = np.asarray(grad_sync)
        h = np.maximum(np.asarray(sync_every, dtype=float), 1.0)
        m = np.maximum(np.asarray(workers, dtype=float), 1.0)
        out = np.ones(np.broadcast_shapes(gs.shape, h.shape, m.shape))
        for name in METHODS:
            t = self.tables[name]
            beyond = (np.log2(np.maximum(1.0, m / float(t["max_workers"])))
                      + np.log2(np.maximum(1.0, h / float(t["max_sync_every"]))))
            out = np.where(gs == name, float(t["factor"]) * (1.0 + float(t["per_doubling"]) * beyond), out)
        return out

    def compression_factor(self, compression: Any, rank: Any) -> np.ndarray:
        """Tokens relative to uncompressed sync of each row's gradient compression."""
        comp = np.asarray(compression)
        r = np.asarray(rank, dtype=np.int64)
        out = np.ones(np.broadcast_shapes(comp.shape, r.shape))
        c = self.tables["compression"]
        for name in ("none", "bf16", "fp8"):
            out = np.where(comp == name, float(c[name]), out)
        ranks = sorted((int(k), float(v)) for k, v in self.tables["powersgd"].items() if k != "source")
        psgd = np.full(out.shape, ranks[0][1])
        for k, v in ranks:  # the factor of the largest listed rank <= r
            psgd = np.where(r >= k, v, psgd)
        return np.where(comp == "powersgd", psgd, out)

    def factor(self, grad_sync: Any, sync_every: Any, workers: Any, compression: Any, rank: Any) -> np.ndarray:
        """Tokens relative to fully synchronous, uncompressed training (>= 0)."""
        return self.method_factor(grad_sync, sync_every, workers) * self.compression_factor(compression, rank)

    def basis(self, grad_sync: str, sync_every: int, workers: int, compression: str, rank: int) -> str:
        """In words, where one plan's factor comes from: published, assumed, or the user's file."""
        parts = []
        if grad_sync in METHODS:
            t = self.tables[grad_sync]
            user = self.origin != DEFAULT_EFFICIENCY.origin and "user override" in str(t.get("source", ""))
            if user:
                parts.append(f"{grad_sync} from {self.origin}")
            elif workers <= t["max_workers"] and sync_every <= t["max_sync_every"]:
                parts.append(f"{grad_sync} within the published regime ({t['max_workers']} workers, H <= "
                             f"{t['max_sync_every']}; " + ("Douillard et al. 2023, on models of 60M-400M parameters: "
                                                           "applying it to larger models is an extrapolation)"
                                                           if grad_sync == "diloco" else "data parallel at H = 1)"))
            else:
                parts.append(f"{grad_sync} beyond the published regime: +{100 * float(t['per_doubling']):g}% per "
                             "doubling (meshplan's assumption)")
        if compression != "none":
            table = "powersgd" if compression == "powersgd" else "compression"
            src = str(self.tables[table].get("source", ""))
            what = f"PowerSGD rank {rank}" if compression == "powersgd" else compression
            parts.append(f"{what} from {self.origin}" if "user override" in src else
                         f"{what}: " + ("Vogels et al. 2019 (rank 1-2 factors are meshplan's translation)"
                                        if compression == "powersgd" else "FP8-LM, Peng et al. 2023"))
        return "; ".join(parts) if parts else "synchronous: 1 by definition"

    def sources(self) -> dict[str, str]:
        """Each table's source sentence."""
        return {k: str(v.get("source", "")) for k, v in self.tables.items()}


DEFAULT_EFFICIENCY = TokenEfficiency()


_LOADED: dict[str, TokenEfficiency] = {}


def token_efficiency(path: str = "") -> TokenEfficiency:
    """The factors of ``path`` (CostParams.token_efficiency_file), loaded once; "" = the defaults."""
    if not path:
        return DEFAULT_EFFICIENCY
    if path not in _LOADED:
        _LOADED[path] = load_token_efficiency(path)
    return _LOADED[path]


def load_token_efficiency(path: str) -> TokenEfficiency:
    """DEFAULTS with the tables of a TOML/JSON file replacing theirs key by key. Every number must
    be a positive factor or count; an unknown table or key is refused with the known ones."""
    from meshplan.spec.io import read_data_file
    data = read_data_file(path)
    tables = {k: dict(v) for k, v in DEFAULTS.items()}
    for name, table in data.items():
        if name in ("schema_version", "kind"):
            continue
        if name not in tables:
            raise MeshplanError(f"{path}: unknown table [{name}]", hint="known tables: " + ", ".join(DEFAULTS))
        if not isinstance(table, dict):
            raise MeshplanError(f"{path}: [{name}] must be a table of key = value")
        for key, value in table.items():
            key = str(key)
            if name != "powersgd" and key not in DEFAULTS[name]:
                raise MeshplanError(f"{path}: [{name}] has no key {key!r}",
                                    hint="known keys: " + ", ".join(DEFAULTS[name]))
            if key == "source":
                tables[name][key] = str(value)
                continue
            if name == "powersgd" and (not key.isdigit() or int(key) < 1):
                raise MeshplanError(f"{path}: [powersgd] keys are ranks (1, 2, 4, ...); got {key!r}")
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if key == "per_doubling":
                if not (ok and value >= 0):
                    raise MeshplanError(f"{path}: [{name}] per_doubling must be a number >= 0; got {value!r}")
                tables[name][key] = value
                continue
            if not ok or value <= 0:
                raise MeshplanError(f"{path}: [{name}] {key} must be a positive number; got {value!r}")
            tables[name][key] = value
        if name in DEFAULTS and "source" not in table:
            tables[name]["source"] = f"{path} (user override)"
    return TokenEfficiency(tables, origin=path)
