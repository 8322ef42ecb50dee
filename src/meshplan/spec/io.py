"""Loading specs from presets, files and command-line shorthand; saving them back.

Presets are data files under ``meshplan/presets/{models,gpus,clusters}/NAME.toml``:
a new GPU or model needs no code. Files carry ``schema_version`` and ``kind``; an optional
``[meta]`` table (source, published parameter count) is kept apart from the spec fields.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from meshplan.builtin_calibration import builtin_gpu_value, part_efficiency
from meshplan.errors import MeshplanError
from meshplan.spec.base import SCHEMA_VERSION, coerce, from_dict, positive, to_dict
from meshplan.spec.cluster import ClusterSpec, GPUSpec, LinkTier, PooledCluster, default_links
from meshplan.spec.links import link_efficiency
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec
from meshplan.spec.plan import Plan, parse_plan

KINDS = ("models", "gpus", "clusters")


def _preset_dir(kind: str) -> Any:
    return resources.files("meshplan") / "presets" / kind


def preset_names(kind: str) -> list[str]:
    """Sorted preset names of one kind (models, gpus, clusters)."""
    d = _preset_dir(kind)
    if not d.is_dir():  # git keeps no empty directories: presets/clusters/ may be absent
        return []
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".toml"))


def _reason(e: BaseException) -> str:
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def _read_toml_text(text: str, where: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except (ValueError, RecursionError) as e:  # TOMLDecodeError; huge ints; deep nesting
        raise MeshplanError(f"{where}: not valid TOML: {_reason(e)}") from None


def read_data_file(path: str | Path) -> dict[str, Any]:
    """Read a .toml or .json file into a dict, with clear errors."""
    p = Path(path)
    try:
        is_file = p.is_file()
    except OSError as e:  # name too long, permission denied, ...
        raise MeshplanError(f"cannot read {p}: {e.strerror or e}") from None
    if not is_file:
        raise MeshplanError(f"file not found: {p}")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise MeshplanError(f"cannot read {p}: {e}") from None
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError; huge ints; deep nesting
            raise MeshplanError(f"{p}: not valid JSON: {_reason(e)}") from None
    else:
        data = _read_toml_text(text, str(p))
    if not isinstance(data, dict):
        raise MeshplanError(f"{p}: expected an object/table at the top level")
    version = data.get("schema_version", SCHEMA_VERSION)
    try:
        version = coerce(version, int, f"{p}.schema_version")
    except MeshplanError:
        pass  # reported just below, as it was written
    if version != SCHEMA_VERSION:
        raise MeshplanError(f"{p}: schema_version {version!r} is not supported (this meshplan reads {SCHEMA_VERSION})")
    _check_finite(data, str(p))
    return data


def _check_finite(value: Any, where: str) -> None:
    """No spec field means anything with inf or nan (TOML's inf/nan, JSON's Infinity/NaN or
    1e400): reject them here rather than let them reach the cost model's arithmetic."""
    if isinstance(value, float) and not math.isfinite(value):
        raise MeshplanError(f"{where}: expected a finite number, got {value}")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(v, f"{where}[{i}]")


def suggest(name: str, names: list[str], n: int = 4) -> list[str]:
    """Known names close to ``name``: those it begins (``h100`` -> every h100 part, shortest
    first), then the closest spellings (``dgx-a10`` -> ``dgx-a100``)."""
    key = name.strip().lower()
    if not key:
        return []
    out = sorted((x for x in names if x.startswith(key) and x != key), key=lambda x: (len(x), x))[:n]
    for x in difflib.get_close_matches(key, names, n=n, cutoff=0.6):
        if x not in out and len(out) < n:
            out.append(x)
    return out


def load_preset_data(kind: str, name: str) -> dict[str, Any]:
    """Raw dict of one preset, or a MeshplanError listing the known ones."""
    names = preset_names(kind)
    key = name.strip().lower()
    if key not in names:
        close = suggest(key, names)
        sugg = f" Did you mean {', '.join(close)}?" if close else ""
        raise MeshplanError(f"unknown {kind[:-1]} {name!r}.{sugg}",
                            hint=f"known {kind}: {', '.join(names)}")
    text = (_preset_dir(kind) / f"{key}.toml").read_text()
    return _read_toml_text(text, f"preset {kind}/{key}")


def _strip_meta(data: dict[str, Any], where: str = "spec") -> tuple[dict[str, Any], dict[str, Any]]:
    if not isinstance(data, dict):
        raise MeshplanError(f"{where}: expected a table/object, got {type(data).__name__}")
    d = dict(data)
    meta = d.pop("meta", {}) or {}
    return d, meta


def preset_meta(kind: str, name: str) -> dict[str, Any]:
    return _strip_meta(load_preset_data(kind, name))[1]


def model_from_dict(data: dict[str, Any], where: str = "model") -> ModelSpec:
    d, _ = _strip_meta(data, where)
    if "model" in d and isinstance(d["model"], dict):
        d = d["model"]
    return from_dict(ModelSpec, d, where=where)


def gpu_from_dict(data: dict[str, Any], where: str = "gpu") -> GPUSpec:
    """A GPUSpec; efficiencies the file does not state come from the built-in calibration of its
    family (times its clock_ratio), else the GPUSpec defaults (priors)."""
    d, _ = _strip_meta(data, where)
    d = dict(d)
    family, ratio = d.get("family"), d.get("clock_ratio", 1.0)
    if isinstance(family, str) and isinstance(ratio, (int, float)) and not isinstance(ratio, bool):
        for f in ("gemm_efficiency", "attention_efficiency"):
            v = builtin_gpu_value(f, family)
            if f not in d and v is not None:
                d[f] = part_efficiency(v, ratio)
    return from_dict(GPUSpec, d, where=where)


def load_gpu(name_or_path: str) -> GPUSpec:
    """A GPU preset name or a .toml/.json file."""
    if name_or_path.endswith((".toml", ".json")):
        return gpu_from_dict(read_data_file(name_or_path), where=name_or_path)
    return gpu_from_dict(load_preset_data("gpus", name_or_path), where=f"gpu {name_or_path}")


def load_model(arg: str, *, seq_len: int | None = None) -> ModelSpec:
    """--model: a preset name or a .toml/.json ModelSpec file. ``hf:``/``module:`` come later."""
    if not isinstance(arg, str) or not arg.strip():
        raise MeshplanError("empty --model", hint="give a preset name (see `meshplan presets`) or a .toml file")
    if arg.startswith(("hf:", "module:")):
        raise MeshplanError(f"--model {arg}: Hugging Face and nn.Module ingestion is not available yet",
                            hint="use a preset or a ModelSpec .toml/.json file")
    if arg.endswith((".toml", ".json")):
        data = read_data_file(arg)
        _not_a_plan_file(arg, data, "--model")
        _not_a_model_file(arg, data)
        m = model_from_dict(data, where=arg)
    else:
        m = model_from_dict(load_preset_data("models", arg), where=f"model {arg}")
    return m.replace(seq_len=seq_len) if seq_len else m


def _not_a_model_file(arg: str, data: dict[str, Any]) -> None:
    """--model given a Hugging Face config or a layer graph where a ModelSpec file is read: say
    what it is and how to give it (it would fail as 'unknown field architectures/source')."""
    if "architectures" in data or "model_type" in data:
        raise MeshplanError(f"--model {arg}: this is a Hugging Face config, not a ModelSpec file",
                            hint=f"give it as --model hf:{arg}")
    if isinstance(data.get("layers"), list):
        src = data.get("source")
        raise MeshplanError(f"--model {arg}: this is a layer graph (from `meshplan ingest --out`): it plans, but "
                            "training needs the model itself",
                            hint=f"train with --model {src}" if isinstance(src, str) and src else
                            "train with --model hf:CONFIG or module:pkg.mod:factory")


def is_plan_document(data: dict[str, Any]) -> bool:
    """A file written by `meshplan plan --out` (kind "plan", or a 'plan' table)."""
    return data.get("kind") == "plan" or isinstance(data.get("plan"), dict)


def _not_a_plan_file(arg: str, data: dict[str, Any], flag: str) -> None:
    """--model/--cluster given a plan file: say so (it would fail as 'unknown field plan')."""
    if not is_plan_document(data):
        return
    what = flag.lstrip("-")
    recorded = data.get(what)
    give = (f"give {flag} {recorded} (the {what} it was planned for); " if isinstance(recorded, str) and recorded
            else "")
    raise MeshplanError(f"{flag} {arg}: this is a plan file (from `meshplan plan --out`), not a {what} file",
                        hint=f"{give}estimate, simulate, report, train and export take it as --plan {arg}")


def parse_cluster_shorthand(arg: str) -> ClusterSpec:
    """'h100-sxm-80gb:64' (the GPU's typical node size, 8 for HGX/DGX parts), 'a100-sxm-80gb:4x8'
    (nodes x per node), or 'gpu' (one node)."""
    name, _, count = arg.partition(":")
    if not name.endswith((".toml", ".json")) and name.strip().lower() not in preset_names("gpus"):
        raise _unknown_cluster(arg, name, count, colon=":" in arg)
    gpu = load_gpu(name)
    per_node = gpu.gpus_per_node
    try:
        if not count:
            nodes = 1
        elif "x" in count.lower():
            a, b = count.lower().split("x", 1)
            nodes, per_node = int(a), int(b)
        else:
            n = int(count)
            if n <= 0:
                raise MeshplanError(f"--cluster {arg}: the GPU count must be a positive integer; got {count}",
                                    hint=f"e.g. {name}:{per_node}")
            if n < per_node:
                nodes, per_node = 1, n
            elif n % per_node:
                d = max(k for k in range(1, per_node + 1) if n % k == 0)  # smaller nodes that fit n
                raise MeshplanError(f"--cluster {arg}: {n} GPUs is not a whole number of {per_node}-GPU nodes",
                                    hint=f"use {name}:{(n // per_node + 1) * per_node}, or NODESxPER_NODE "
                                         f"like {name}:{n // d}x{d} (or write a cluster .toml)")
            else:
                nodes = n // per_node
    except MeshplanError:  # a ValueError too: let its specific message through
        raise
    except ValueError:
        raise MeshplanError(f"--cluster {arg}: cannot read GPU count {count!r}",
                            hint="use GPU:COUNT like h100-sxm-80gb:64, "
                                 "or GPU:NODESxPER_NODE like a100-sxm-80gb:4x8") from None
    if nodes <= 0 or per_node <= 0:
        raise MeshplanError(f"--cluster {arg}: the node and per-node GPU counts must be positive integers",
                            hint=f"e.g. {name}:4x{gpu.gpus_per_node}")
    intra, inter = default_links(gpu)
    return ClusterSpec(name=arg, gpu=gpu, num_nodes=nodes, gpus_per_node=per_node,
                       intra_node=intra, inter_node=inter)


def _unknown_cluster(arg: str, name: str, count: str, *, colon: bool) -> MeshplanError:
    """--cluster names no GPU preset (nor, without a count, a cluster preset): say which names
    are close, in the form given (``h100:8`` -> ``h100-sxm-80gb:8``; ``dgx-a10`` -> ``dgx-a100``)."""
    gpus, clusters = preset_names("gpus"), preset_names("clusters")
    key = name.strip().lower()
    tail = f":{count}" if colon else ""
    if colon and key in clusters:  # a cluster preset with a count: its GPU at that count
        gpu = cluster_from_dict(load_preset_data("clusters", key), where=f"cluster {key}").gpu.name
        return MeshplanError(f"--cluster {arg}: {key} is a cluster preset of fixed size, not a GPU; "
                             f"did you mean {gpu}{tail}?",
                             hint=f"GPU:COUNT takes a GPU preset (known gpus: {', '.join(gpus)}); "
                                  f"or --cluster {key} alone")
    close = [g + tail for g in suggest(key, gpus)] if colon else suggest(key, clusters + gpus)
    what = "gpu" if colon else "cluster or gpu"
    sugg = f"; did you mean {', '.join(close)}?" if close else ""
    known = f"known gpus: {', '.join(gpus)}" + ("" if colon else f"; known clusters: {', '.join(clusters)}")
    return MeshplanError(f"--cluster {arg}: unknown {what} {name!r}{sugg}",
                         hint=f"{known}; or GPU:COUNT like h100-sxm-80gb:64, or a cluster .toml")


def cluster_from_dict(data: dict[str, Any], where: str = "cluster") -> ClusterSpec:
    d, _ = _strip_meta(data, where)
    d = dict(d)
    if "pools" in d:
        return pooled_from_dict(d, where)  # type: ignore[return-value]
    gpu = d.get("gpu")
    if isinstance(gpu, str):
        d["gpu"] = load_gpu(gpu)
    elif gpu is None:
        raise MeshplanError(f"{where}: missing 'gpu' (a preset name like 'h100-sxm-80gb' or a [gpu] table)")
    elif not isinstance(gpu, (dict, GPUSpec)):
        raise MeshplanError(f"{where}: gpu must be a preset name like 'h100-sxm-80gb' or a [gpu] table; "
                            f"got {type(gpu).__name__}")
    if d.get("nodes_per_dc") is not None:  # ClusterSpec would divide by it before checking it
        d["nodes_per_dc"] = coerce(d["nodes_per_dc"], int, f"{where}.nodes_per_dc")
        positive(f"{where}: nodes_per_dc", d["nodes_per_dc"])
    g = d["gpu"] if isinstance(d["gpu"], GPUSpec) else gpu_from_dict(d["gpu"], where=f"{where}.gpu")
    d["gpu"] = g
    intra, inter = default_links(g)
    d.setdefault("intra_node", intra)
    d.setdefault("inter_node", inter)
    for tier in ("intra_node", "inter_node", "inter_dc"):
        if isinstance(d.get(tier), dict):
            d[tier] = _link_from_dict(d[tier], to_dict(intra if tier == "intra_node" else inter), tier,
                                      f"{where}.{tier}")
    if "site_links" in d:
        d["site_links"], slowest = _site_links(d["site_links"], d.get("inter_dc"), where)
        if d.get("inter_dc") is None and slowest is not None:
            d["inter_dc"] = slowest  # no [inter_dc]: the slowest pair's link (any pair not listed uses it)
        if d.get("nodes_per_dc") is None and d["site_links"]:
            raise MeshplanError(f"{where}: site_links need nodes_per_dc (the nodes of one site)",
                                hint="e.g. nodes_per_dc = 4 for sites of 4 nodes each")
    return from_dict(ClusterSpec, d, where=where)


def _link_from_dict(raw: dict[str, Any], base: dict[str, Any], tier: str, where: str) -> LinkTier:
    """One link table over ``base`` (the default link of its tier). A link that names its kind but
    no efficiency gets the kind's efficiency (spec.links: the calibration's fitted value, else the
    per-kind default; an unknown kind is an error); a link without a kind keeps the base's kind and
    efficiency."""
    merged = {**base, "name": tier, **raw}
    kind = raw.get("kind")
    if "efficiency" not in raw and isinstance(kind, str) and kind.strip():
        merged["efficiency"] = link_efficiency(tier, kind, where=where)
    return from_dict(LinkTier, merged, where=where)


SITE_LINK_KEYS = ("sites", "bandwidth_gbps", "latency_us", "efficiency", "shared", "kind")


def _site_links(raw: Any, inter_dc: Any, where: str) -> tuple[tuple[LinkTier, ...], LinkTier | None]:
    """[[site_links]] tables: each joins two sites (``sites = [a, b]``, 0-based); what it leaves out
    comes from [inter_dc], then (efficiency) from its kind. Returns the links and, for a file
    without [inter_dc], the slowest of them as the cluster's inter_dc."""
    if not isinstance(raw, (list, tuple)) or not all(isinstance(x, (dict, LinkTier)) for x in raw):
        raise MeshplanError(f"{where}: site_links must be a list of tables ([[site_links]] in TOML, each with "
                            "sites = [a, b] and bandwidth_gbps)")
    base = to_dict(inter_dc) if isinstance(inter_dc, LinkTier) else {"kind": "wan"}
    base = {k: v for k, v in base.items() if k != "sites"}
    links = []
    for i, entry in enumerate(raw):
        w = f"{where}.site_links[{i}]"
        if isinstance(entry, LinkTier):
            links.append(entry)
            continue
        if entry.get("name", "inter_dc") == "inter_dc":  # written back by to_dict (plan files' cluster_spec)
            entry = {k: v for k, v in entry.items() if k != "name"}
        unknown = sorted(set(entry) - set(SITE_LINK_KEYS))
        if unknown:
            raise MeshplanError(f"{w}: unknown key {unknown[0]!r}", hint="known keys: " + ", ".join(SITE_LINK_KEYS))
        sites = entry.get("sites")
        if (not isinstance(sites, list) or len(sites) != 2
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in sites)):
            raise MeshplanError(f"{w}: sites must be two site numbers (0-based); got {sites!r}",
                                hint="e.g. sites = [0, 1]")
        if not isinstance(inter_dc, LinkTier):
            missing = [k for k in ("bandwidth_gbps", "latency_us") if k not in entry]
            if missing:
                raise MeshplanError(f"{w}: missing {', '.join(missing)} (there is no [inter_dc] to take it from)",
                                    hint="give each site link bandwidth_gbps (GB/s) and latency_us, or an "
                                         "[inter_dc] table with the defaults")
        e = dict(entry)
        if "efficiency" not in e and "kind" not in e and not isinstance(inter_dc, LinkTier):
            e["kind"] = base["kind"]  # a new link of the default kind: that kind's efficiency
        try:
            links.append(_link_from_dict({**e, "sites": tuple(sites)}, base, "inter_dc", w))
        except MeshplanError as err:  # name the entry, not the tier it is modelled as
            raise MeshplanError(err.message.replace("link inter_dc", w), hint=err.hint) from None
    slowest = None
    if links and not isinstance(inter_dc, LinkTier):
        s = min(links, key=lambda t: t.bytes_per_s)
        slowest = LinkTier(**{**to_dict(s), "sites": None})
    return tuple(links), slowest


def pooled_from_dict(d: dict[str, Any], where: str) -> PooledCluster | ClusterSpec:
    """A cluster file with [[pools]] (spec.cluster.PooledCluster): every pool is a cluster table of
    its own (name, gpu, num_nodes, gpus_per_node, intra_node, inter_node, ...); [inter_pool] is the
    link between pools (default: the slowest pool's inter_node link). One [[pools]] table is a
    homogeneous cluster: that pool's ClusterSpec (a cluster of one pool, named after the pool, so a
    plan's pools=NAME places it there)."""
    pools_raw = d.pop("pools")
    if not isinstance(pools_raw, list) or not all(isinstance(x, dict) for x in pools_raw):
        raise MeshplanError(f"{where}: pools must be a list of tables ([[pools]] in TOML)",
                            hint="see docs/heterogeneous-hardware.md for an example")
    if not pools_raw:
        raise MeshplanError(f"{where}: pools is empty; a cluster has at least one [[pools]] table",
                            hint="see docs/heterogeneous-hardware.md for an example")
    top = {k: d.pop(k) for k in ("gpu", "num_nodes", "gpus_per_node", "nodes_per_dc", "inter_dc", "site_links",
                                 "node_nic_gbps") if k in d}
    if top:
        raise MeshplanError(f"{where}: {', '.join(sorted(top))} belong inside each [[pools]] table of a pooled "
                            "cluster, not at the top level")
    pools = []
    for i, raw in enumerate(pools_raw):
        if "name" not in raw:
            raise MeshplanError(f"{where}: pools[{i}] needs a name (e.g. name = \"h100\")")
        pools.append(cluster_from_dict(raw, where=f"{where}.pools[{i}]"))
    inter = d.pop("inter_pool", None)
    slowest = min((p.inter_node for p in pools), key=lambda t: t.bytes_per_s)
    if inter is None:
        link = LinkTier(**{**to_dict(slowest), "name": "inter_pool"})
    elif isinstance(inter, dict):
        link = _link_from_dict(inter, to_dict(slowest), "inter_pool", f"{where}.inter_pool")
    else:
        raise MeshplanError(f"{where}: inter_pool must be a table ([inter_pool] with bandwidth_gbps, ...)")
    for k in ("step_jitter", "price_per_gpu_hour_usd"):
        if k in d:
            raise MeshplanError(f"{where}: {k} belongs inside each [[pools]] table")
    if len(pools) == 1:  # one GPU type: no other pool to link to ([inter_pool], if given, is unused)
        rest = sorted(set(d) - {"name", "schema_version", "kind"})  # the file header aside
        if rest:
            raise MeshplanError(f"{where}: {', '.join(rest)}: not a setting of a cluster of one [[pools]] table",
                                hint="put the pool's settings inside its [[pools]] table")
        return pools[0]
    return from_dict(PooledCluster, {**d, "pools": tuple(pools), "inter_pool": link}, where=where)


def load_cluster(arg: str) -> ClusterSpec:
    """--cluster: shorthand GPU:COUNT, a cluster preset, or a .toml/.json file (or a name that
    carries its loaded spec, cli.planfile.Loaded: a plan file's cluster)."""
    if isinstance(getattr(arg, "loaded", None), (ClusterSpec, PooledCluster)):
        return arg.loaded  # type: ignore[attr-defined]
    if not isinstance(arg, str) or not arg.strip():
        raise MeshplanError("empty --cluster", hint="e.g. --cluster h100-sxm-80gb:64")
    if arg.endswith((".toml", ".json")):
        data = read_data_file(arg)
        _not_a_plan_file(arg, data, "--cluster")
        return cluster_from_dict(data, where=arg)
    if ":" not in arg and arg.lower() in preset_names("clusters"):
        return cluster_from_dict(load_preset_data("clusters", arg), where=f"cluster {arg}")
    if arg.strip().lower().partition(":")[0] == "local-cpu":
        return local_cpu_cluster(arg)
    return parse_cluster_shorthand(arg)


def local_cpu_cluster(arg: str) -> ClusterSpec:
    """--cluster local-cpu[:N | :NODESxPER_NODE]: this machine's CPU as N 'GPUs' of one core each, the
    device `meshplan train` prints its CPU estimates for (spec.local_cpu.cpu_cluster), so that a name
    meshplan prints is one it takes (issue 29). Its rate: $MESHPLAN_CPU_TFLOPS (what `train` measured),
    else numpy's fp32 256x256 matmul rate measured here (torch is not imported by planning)."""
    import os
    import time

    import numpy as np

    from meshplan.spec.local_cpu import CPU_TFLOPS_ENV, cpu_cluster
    _, _, count = arg.strip().partition(":")
    try:
        if not count:
            nodes, per = 1, 1
        elif "x" in count.lower():
            nodes, per = (int(x) for x in count.lower().split("x", 1))
        else:
            nodes, per = 1, int(count)
        if nodes <= 0 or per <= 0:
            raise ValueError
    except ValueError:
        raise MeshplanError(f"--cluster {arg}: expected local-cpu, local-cpu:N or local-cpu:NODESxPER_NODE "
                            "(N processes of one core each)", hint="e.g. --cluster local-cpu:4") from None
    rate = None
    try:
        rate = float(os.environ.get(CPU_TFLOPS_ENV, "")) or None
    except ValueError:
        rate = None
    if rate is None:
        a = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)
        a @ a
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.1:
            a @ a
            n += 1
        rate = 2 * 256**3 * n / (time.perf_counter() - t0) / 1e12
    return cpu_cluster(nodes * per, rate, nodes=nodes)


PLAN_HINT = "a plan string like tp=8,pp=4,dp=16,micro_batch=1, or a plan file from `meshplan plan --out`"


def load_plan(arg: str) -> Plan:
    """--plan: 'tp=..,pp=..' or a plan file (.json/.toml, as written by `meshplan plan --out`)."""
    if isinstance(arg, str) and arg.lower().endswith((".toml", ".json")):
        _check_not_empty(arg, "plan")
        data = read_data_file(arg)
        if "plan" in data:  # a document written by `meshplan plan --out`
            if not isinstance(data["plan"], dict):
                raise MeshplanError(f"{arg}: 'plan' must be an object/table of plan fields; "
                                    f"got {type(data['plan']).__name__}")
            data = data["plan"]
        else:
            _check_holds_plan(arg, data)
        if isinstance(data.get("stage_layers"), str):  # the plan string's form, e.g. "4x31:2"
            from meshplan.spec.plan import parse_stage_layers
            data = {**data, "stage_layers": parse_stage_layers(data["stage_layers"], f"{arg}.stage_layers")}
        from meshplan.spec.plan import COLON_LISTS, parse_colon_list
        data = {**data, **{k: parse_colon_list(data[k], k) for k in COLON_LISTS if isinstance(data.get(k), str)}}
        return from_dict(Plan, data, where=arg)
    if isinstance(arg, str) and "=" not in arg and _looks_like_path(arg):
        what = ("is a directory, not a plan file" if os.path.isdir(arg) else
                "is not a plan file (plan files are .json or .toml, written by `meshplan plan --out`)"
                if os.path.exists(arg) else "is no such file, nor a plan string (key=value,...)")
        raise MeshplanError(f"--plan {arg} {what}", hint=f"give {PLAN_HINT}")
    return parse_plan(arg)


def _looks_like_path(arg: str) -> bool:
    """A --plan value meant as a file: it exists, or has a directory part or a file extension."""
    import re
    try:
        if os.path.exists(arg):
            return True
    except (OSError, ValueError):
        return False
    return "/" in arg or os.sep in arg or re.search(r"\.[A-Za-z][A-Za-z0-9]{0,4}$", arg.strip()) is not None


def _check_not_empty(arg: str, what: str) -> None:
    """An empty file (before it is parsed, which would only say "not valid JSON")."""
    try:
        empty = os.path.isfile(arg) and os.path.getsize(arg) == 0
    except OSError:
        return  # read_data_file says why it cannot be read
    if empty:
        raise MeshplanError(f"{arg}: the file is empty: it holds no {what}",
                            hint=f"give {PLAN_HINT}" if what == "plan" else None)


def _check_holds_plan(arg: str, data: dict[str, Any]) -> None:
    """A file without a 'plan' table must hold plan fields (a model or cluster file, or ``{}``, is
    not a plan: it would load as the default plan)."""
    from meshplan.spec.plan import PLAN_FIELDS, PLAN_KEY_ALIASES
    fields = set(PLAN_FIELDS) | set(PLAN_KEY_ALIASES)
    keys = {str(k).lower() for k in data} - {"schema_version", "kind", "meta"}
    kind = data.get("kind")
    if isinstance(kind, str) and kind not in ("plan", "plans"):
        raise MeshplanError(f"{arg}: this is a {kind.rstrip('s')} file, not a plan file: it holds no plan",
                            hint=f"give {PLAN_HINT}")
    if not keys & fields:
        what = ("a model file" if {"hidden_size", "num_layers"} <= keys else
                "a layer graph" if "layers" in keys else
                "a cluster file" if "gpu" in keys or "num_nodes" in keys else None)
        raise MeshplanError(f"{arg}: the file holds no plan (no 'plan' table and no plan fields such as "
                            "tp, pp, dp)" + (f"; it looks like {what}" if what else ""), hint=f"give {PLAN_HINT}")


def plan_document(plan: Plan, **extra: Any) -> dict[str, Any]:
    """A schema-versioned plan file body: the plan plus whatever context (model, predicted cost)."""
    return {"schema_version": SCHEMA_VERSION, "kind": "plan", "plan": to_dict(plan), **extra}


def dump_json(obj: Any) -> str:
    return json.dumps(to_dict(obj), indent=2, sort_keys=False)


def toml_value(v: Any) -> str:
    """One TOML value: booleans, numbers, strings, lists and (inline) tables of them."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()
                               if x is not None) + "}"
    raise MeshplanError(f"cannot write {type(v).__name__} to TOML")


def dump_toml(obj: Any) -> str:
    """A spec (or spec dict) as TOML: scalars first, nested specs as [tables]; None omitted.
    read back by load_model / load_cluster / load_plan."""
    data = to_dict(obj)
    lines, tables = [], []
    for k, v in data.items():
        if v is None:
            continue
        (tables if isinstance(v, dict) else lines).append((k, v))
    out = [f"{json.dumps(k)} = {toml_value(v)}" for k, v in lines]
    for name, table in tables:
        out.append(f"\n[{json.dumps(name)}]")
        out += [f"{json.dumps(k)} = {toml_value(x)}" for k, x in table.items() if x is not None]
    return "\n".join(out) + "\n"


# ---- plan files ----------------------------------------------------------------------------------
# What `meshplan plan --out p.json` writes and what estimate, simulate, report, export and train read
# back: the plan (plan_document) plus the problem it was planned for: ``model`` and ``cluster`` (the
# names shown to people), ``model_spec`` and ``cluster_spec`` (the full specs, so a model or cluster
# from a file, or a layer graph, reloads exactly and without torch), ``global_batch`` and ``seq_len``.
# cli.planfile resolves a command's flags against them.

PLAN_CONTEXT = ("model", "cluster", "global_batch", "seq_len", "optimizer")
"""What a plan file records besides the plan (``optimizer``: the workload's; a file without one
was planned for AdamW)."""

PLAN_CONTEXT_FLAGS = {"model": "--model", "cluster": "--cluster", "global_batch": "--global-batch",
                      "seq_len": "--seq-len", "optimizer": "--optimizer"}
PLAN_CONTEXT_WHAT = {"model": "model", "cluster": "cluster", "global_batch": "global batch",
                     "seq_len": "sequence length", "optimizer": "optimizer"}


def spec_fields(model: Any, cluster: Any) -> dict[str, Any]:
    """``model_spec`` and ``cluster_spec`` of a plan document: the full specs planned with
    (a ModelSpec or a LayerGraph; a ClusterSpec), so the file reloads them exactly."""
    out: dict[str, Any] = {}
    if model is not None:  # a generated graph records the description it was generated from
        out["model_spec"] = to_dict(getattr(model, "model", None) or model)
    if cluster is not None:
        out["cluster_spec"] = to_dict(cluster)
    return out


def plain_json(obj: Any) -> Any:
    """json's ``default=``: numpy scalars and arrays (a vectorised cost model may return them) as
    plain JSON."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def write_plan_file(path: str, doc: dict[str, Any]) -> None:
    """--out: a plan document as TOML (a .toml path) or JSON; numpy values as plain numbers."""
    try:
        with open(path, "w") as f:
            if path.lower().endswith(".toml"):
                f.write(dump_toml(json.loads(json.dumps(doc, default=plain_json))))
            else:
                json.dump(doc, f, indent=2, default=plain_json)
                f.write("\n")
    except OSError as e:
        raise MeshplanError(f"cannot write --out {path}: {e.strerror or e}") from None


def is_file_arg(arg: Any) -> bool:
    """A command-line value naming a .json or .toml file (not a name or a shorthand)."""
    return isinstance(arg, str) and arg.lower().endswith((".json", ".toml"))


@dataclass(frozen=True)
class PlanFile:
    """The context a plan document records (only the keys it has)."""

    path: str
    values: dict[str, Any]
    """model, cluster (names), global_batch, seq_len (positive ints), optimizer (spec.plan.OPTIMIZERS)."""
    model_spec: dict[str, Any] | None = None
    cluster_spec: dict[str, Any] | None = None


def read_plan_file(arg: Any, fields: tuple[str, ...] = PLAN_CONTEXT) -> PlanFile | None:
    """The context of a plan document written by `meshplan plan --out` (None for a plan string,
    or a file holding only plan fields). Only ``fields`` are read and checked."""
    if not is_file_arg(arg):
        return None
    data = read_data_file(arg)
    if "plan" not in data:
        return None
    values: dict[str, Any] = {}
    for key in fields:
        v = data.get(key)
        if v is None:
            continue
        flag = PLAN_CONTEXT_FLAGS[key]
        if key in ("model", "cluster"):
            if not isinstance(v, str) or not v.strip():
                raise MeshplanError(f"{arg}: '{key}' must be a {PLAN_CONTEXT_WHAT[key]} name; got {v!r}",
                                    hint=f"fix the file or give {flag}")
            values[key] = v.strip()
        elif key == "optimizer":
            from meshplan.spec.plan import OPTIMIZERS
            if v not in OPTIMIZERS:
                raise MeshplanError(f"{arg}: 'optimizer' must be one of {', '.join(OPTIMIZERS)}; got {v!r}",
                                    hint=f"fix the file or give {flag}")
            values[key] = v
        else:
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise MeshplanError(f"{arg}: '{key}' must be a positive integer; got {v!r}",
                                    hint=f"fix the file or give {flag}")
            values[key] = v
    specs: dict[str, dict[str, Any] | None] = {}
    for key in ("model", "cluster"):
        spec = data.get(f"{key}_spec") if key in fields else None
        if spec is not None and not isinstance(spec, dict):
            raise MeshplanError(f"{arg}: '{key}_spec' must be an object/table of {PLAN_CONTEXT_WHAT[key]} "
                                f"fields; got {type(spec).__name__}",
                                hint=f"fix the file or give {PLAN_CONTEXT_FLAGS[key]}")
        specs[key] = spec
    return PlanFile(path=arg, values=values, model_spec=specs["model"], cluster_spec=specs["cluster"])


def beside_plan_file(arg: str, plan_path: str) -> str:
    """A file named in a plan file: as written, else next to the plan file."""
    if is_file_arg(arg) and not os.path.isabs(arg) and not os.path.exists(arg):
        beside = os.path.join(os.path.dirname(plan_path), arg)
        if os.path.exists(beside):
            return beside
    return arg


def model_from_plan_spec(spec: dict[str, Any], path: str, seq_len: int | None) -> Any:
    """A plan file's model_spec: a ModelSpec (like load_model_arg, whatever ``seq_len``: the
    workload carries it), or a LayerGraph (it has 'layers'); None when a graph was traced at
    another sequence length than asked (then it is ingested again)."""
    where = f"{path}: model_spec"
    if isinstance(spec.get("layers"), list):
        data = {k: v for k, v in spec.items() if k not in ("schema_version", "kind", "meta")}
        graph = from_dict(LayerGraph, data, where=where)
        return graph if seq_len is None or seq_len == graph.sample_tokens else None
    return model_from_dict(spec, where=where)  # as planned: the workload carries the seq len
