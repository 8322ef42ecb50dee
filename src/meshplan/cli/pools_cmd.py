"""Whether a command's cluster (or its --plan file's) has several GPU pools: `is_pooled`, for the
commands that refuse such a cluster (export). `plan` and `report` take any cluster
(search.search); `estimate` and `simulate` too (cost.estimate, sim.simulate)."""
from __future__ import annotations

import argparse
from typing import Any

from meshplan.errors import MeshplanError


def is_pooled(arg: Any, args: argparse.Namespace | None = None) -> bool:
    """Whether --cluster (or, without it, the cluster a --plan file records) has several pools.
    With ``args``, a pooled plan file's model, cluster, global batch and sequence fill the flags
    that were not given (the file reloads as `meshplan plan --out` wrote it)."""
    from meshplan.spec.cluster import PooledCluster
    from meshplan.spec.io import load_cluster
    if arg is None and args is not None:
        arg = _file_cluster(args)
    if arg is None:
        return False
    try:
        pooled = isinstance(load_cluster(arg), PooledCluster)
    except MeshplanError:
        return False  # the command's own loading says what is wrong
    if pooled and args is not None:
        _fill_from_plan_file(args, arg)
    return pooled


def _plan_doc(args: argparse.Namespace) -> tuple[str, dict[str, Any]] | None:
    from meshplan.spec.io import is_file_arg, read_data_file
    path = getattr(args, "plan", None)
    if not is_file_arg(path):
        return None
    try:
        doc = read_data_file(path)
    except MeshplanError:
        return None  # the plan's own loading says what is wrong
    return (path, doc) if isinstance(doc, dict) and isinstance(doc.get("plan"), dict) else None


def _file_cluster(args: argparse.Namespace) -> str | None:
    """The pooled cluster a --plan file records (next to the file when relative)."""
    from meshplan.spec.io import beside_plan_file
    got = _plan_doc(args)
    if got is None or not isinstance(got[1].get("cluster"), str):
        return None
    return beside_plan_file(got[1]["cluster"], got[0])


def _fill_from_plan_file(args: argparse.Namespace, cluster: str) -> None:
    got = _plan_doc(args)
    if getattr(args, "cluster", None) is None:
        args.cluster = cluster
    if got is None:
        return
    doc = got[1]
    for key in ("model", "global_batch", "seq_len"):
        if key == "seq_len" and doc.get("lengths"):
            continue  # a recorded distribution: cli.lengths_arg.lengths_of reads it (and its longest) from the file
        if getattr(args, key, None) is None and doc.get(key) is not None:
            setattr(args, key, doc[key])
    # (a recorded length distribution is read by cli.lengths_arg.lengths_of from the file itself)
