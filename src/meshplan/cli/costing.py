"""--profile and --calibration: which cost model a planning command prices with, and saying so.

    costing(args).params        CostParams: the profile's choices, then the calibration's values
    costing(args).cluster(c)    the cluster with the calibration's GPU and link efficiencies
    costing(args).lines()       what the output prints about both (nothing for the defaults)
    costing(args).to_json()     the same for --json
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from meshplan.calibration.store import Calibration, load_calibration
from meshplan.cost.params import DEFAULT_PARAMS, CostParams
from meshplan.cost.profile import DEFAULT_PROFILE, PROFILES, Profile, get_profile
from meshplan.errors import MeshplanError

CAL_HELP = ("a calibration file from `meshplan calibrate` (its fitted values replace the built-in ones; "
            "the output lists them)")


def add_cost_flags(p: argparse.ArgumentParser, *, profile: bool = True, policy: bool = False) -> None:
    from meshplan.cli.args import Once
    p.add_argument("--calibration", metavar="FILE", action=Once, help=CAL_HELP)
    if policy:
        p.add_argument("--max-oom-risk", metavar="P", action=Once, type=_risk,
                       help="the largest chance of running out of memory (strictly between 0 and 1, from the "
                            "memory model's out-of-sample errors) at which a plan is still recommended (default 0.05); "
                            "plans above it are 'at-risk'")
        p.add_argument("--headroom", metavar="GiB", action=Once, type=_gib,
                       help="memory a recommended plan must leave free below the usable memory, GiB (default 0)")
        p.add_argument("--token-efficiency", metavar="FILE", action=Once,
                       help="a TOML file of token-efficiency factors (tokens a sync method or compression needs "
                            "relative to fully synchronous training) replacing meshplan's cited defaults; see "
                            "docs/weak-links.md")
    if profile:
        p.add_argument("--profile", metavar="NAME|FILE", action=Once,
                       help="the training codebase whose kernels and buffers to price: "
                            f"{', '.join(PROFILES)}, or a profile .toml (default: {DEFAULT_PROFILE}, "
                            "meshplan's own runtime)")


def _risk(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a probability strictly between 0 and 1 (e.g. 0.05 for "
                                         "5%; 0.5 or more accepts every plan that fits)")
    return v


def _gib(text: str) -> float:
    import math
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size in GiB (a number >= 0, e.g. 4)")
    return v


@dataclass(frozen=True)
class Costing:
    params: CostParams
    profile: Profile
    calibration: Calibration | None

    def cluster(self, c: Any) -> Any:
        """``c`` with the calibration's efficiencies, on every pool of a cluster of several."""
        if self.calibration is None:
            return c
        if len(c.pools) > 1:
            return dataclasses.replace(c, pools=tuple(self.calibration.apply_cluster(p) for p in c.pools))
        return self.calibration.apply_cluster(c)

    def lines(self) -> list[str]:
        out = []
        band = self.knowledge_band()
        if self.profile.name != DEFAULT_PROFILE:
            out.append(f"profile      {self.profile.name}: {self.profile.label}")
            out += [f"             {line}" for line in self.profile.describe()]
        if self.calibration is not None:
            vals = self.calibration.describe()
            out.append(f"calibration  {self.calibration.source}: {len(vals)} fitted values replace the built-in ones")
            out += [f"             {v}" for v in vals]
            if self.params.band_scale != 1.0 and band is None:
                out.append(f"             bands x {self.params.band_scale:.2f}: the step error it earned on its runs")
        if band is not None:
            from meshplan.cost.uncertainty import KNOWLEDGE_WORDS
            out.append(f"step band    {100 * (math.exp(band[0]) - 1):+.0f}% to {100 * (math.exp(band[1]) - 1):+.0f}%: "
                       f"{KNOWLEDGE_WORDS[self.params.band_basis]}")
        return out

    def knowledge_band(self) -> tuple[float, float] | None:
        """The step band of how well the codebase is known, where it is not a built-in profile's."""
        from meshplan.cost.uncertainty import builtin_bands
        return builtin_bands().knowledge_log(self.params.band_basis)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"profile": self.profile.name,
                               "memory_policy": {"max_oom_risk": self.params.max_oom_risk,
                                                 "headroom_gib": self.params.headroom_gib},
                               "band_scale": self.params.band_scale, "band_basis": self.params.band_basis}
        if self.profile.name != DEFAULT_PROFILE:
            out["profile_settings"] = dict(self.profile.overrides)
        if self.calibration is not None:
            out["calibration"] = {"file": self.calibration.source, "values": dict(self.calibration.values),
                                  "fitted_from": self.calibration.info.get("fitted_from")}
        return out


def recorded(args: argparse.Namespace) -> dict[str, str]:
    """The profile, calibration and token-efficiency file a --plan FILE (from `meshplan plan --out`)
    was priced with."""
    import os

    from meshplan.spec.io import is_file_arg, read_data_file
    path = getattr(args, "plan", None)
    if not is_file_arg(path):
        return {}
    try:
        data = read_data_file(path)
    except MeshplanError:
        return {}  # the command's own reading of --plan says what is wrong with it
    out = {k: data[k] for k in ("profile", "calibration", "token_efficiency")
           if isinstance(data, dict) and isinstance(data.get(k), str)}
    for key in ("calibration", "token_efficiency"):
        f = out.get(key)
        if f and not os.path.isabs(f) and not os.path.exists(f):
            near = os.path.join(os.path.dirname(path), f)  # written relative to where the plan was made
            out[key] = near if os.path.exists(near) else f
    return out


def costing(args: argparse.Namespace) -> Costing:
    """The Costing of a command's --profile/--calibration (built once per command); a --plan FILE's
    recorded profile and calibration apply when the command line gives none (and it says so)."""
    import sys
    got = getattr(args, "_costing", None)
    if got is not None:
        return got
    rec = recorded(args)
    for key, flag in (("profile", "--profile"), ("calibration", "--calibration"),
                      ("token_efficiency", "--token-efficiency")):
        if getattr(args, key, None) is None and key in rec and hasattr(args, key):
            setattr(args, key, rec[key])
            print(f"meshplan: note: {flag} {rec[key]} as the plan file records (pass {flag} to change it)",
                  file=sys.stderr)
    prof = get_profile(getattr(args, "profile", None))
    path = getattr(args, "calibration", None)
    cal = load_calibration(path) if path else None
    params = prof.apply(DEFAULT_PARAMS)
    if cal is not None:
        params = cal.apply_params(params)
    if getattr(args, "max_oom_risk", None) is not None:
        params = params.replace(max_oom_risk=args.max_oom_risk)
    if getattr(args, "headroom", None) is not None:
        params = params.replace(headroom_gib=args.headroom)
    if getattr(args, "token_efficiency", None):
        from meshplan.cost.convergence import token_efficiency
        token_efficiency(args.token_efficiency)  # read and checked now: a bad file fails before any work
        params = params.replace(token_efficiency_file=args.token_efficiency)
    c = Costing(params, prof, cal)
    args._costing = c
    return c
