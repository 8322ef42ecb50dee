"""The GPU preset and the cluster of a published run.

``gpu_preset`` maps the row's gpu_type (and memory) to a preset; ``known_system`` recognises a
documented training system with its own cluster preset (its real links); otherwise
``build_cluster`` sizes the GPU's typical nodes to the run.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from meshplan.errors import MeshplanError
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.io import load_cluster, load_gpu, parse_cluster_shorthand, preset_names
from meshplan.validate.rows import Row, Unsupported


def _nearest(mem: float, options: tuple[float, ...]) -> float | None:
    best = min(options, key=lambda o: abs(o - mem))
    return best if abs(best - mem) <= 0.1 * best else None


def gpu_preset_for(gpu_type: str, memory_gb: float | None,
                   assume: Callable[[str], None]) -> str:
    """Map a row's gpu_type + gpu_memory_gb to a GPU preset name (which may not exist yet)."""
    t = gpu_type.lower().replace("_", "-")
    if memory_gb is None:
        m = re.search(r"(\d+(?:\.\d+)?)\s*gi?b", t)
        memory_gb = float(m.group(1)) if m else None
    pcie = "pcie" in t

    def mem_or(default: float, options: tuple[float, ...], label: str) -> float:
        if memory_gb is None:
            assume(f"gpu_memory_gb not stated: assumed {default:g} GB {label}")
            return default
        near = _nearest(memory_gb, options)
        if near is None:
            raise Unsupported(f"no GPU preset for {gpu_type!r} with {memory_gb:g} GB")
        return near

    if "mi300x" in t or "mi300" in t:
        return "mi300x-192gb"
    if "gb200" in t:  # the Blackwell GPU of a GB200 superchip (NVL72 rack: a 72-GPU NVLink domain)
        return "gb200-nvl72-186gb"
    if "gh200" in t:
        if memory_gb is None and "hbm3e" in t:
            return "gh200-144gb"
        return "gh200-144gb" if mem_or(96, (96, 144), "(GH200)") == 144 else "gh200-96gb"
    if "b200" in t:
        return "b200-sxm-192gb"
    if "h200" in t:
        return "h200-sxm-141gb"
    if "h100" in t:
        if "nvl" in t:
            return "h100-nvl-94gb"
        if pcie:
            return "h100-pcie-80gb"
        if "500w" in t or "hbm2e" in t:
            return "h100-sxm-96gb-500w"
        mem = mem_or(80, (80, 96), "(H100 SXM5)")
        return "h100-sxm-96gb-500w" if mem == 96 else "h100-sxm-80gb"
    if "a100" in t:
        mem = mem_or(80, (40, 80), "(A100)")
        form = "pcie" if pcie else "sxm"
        if not pcie and "sxm" not in t:
            assume("A100 form factor not stated: assumed SXM4 (HGX/DGX)")
        return f"a100-{form}-{int(mem)}gb"
    if "v100" in t:
        mem = mem_or(32, (16, 32), "(V100)")
        if not pcie and "sxm" not in t:
            assume("V100 form factor not stated: assumed SXM2 (DGX-1/DGX-2)")
        return f"v100-{'pcie' if pcie else 'sxm'}-{int(mem)}gb"
    if "l40s" in t:
        return "l40s-48gb"
    raise Unsupported(f"no GPU preset for gpu_type {gpu_type!r}")


def gpu_preset(row: Row, assume: Callable[[str], None]) -> str:
    """The row's GPU preset name; Unsupported when gpu_type is blank or has no preset file."""
    gpu_type = row.text("gpu_type")
    if gpu_type is None:
        raise Unsupported("gpu_type not stated")
    name = gpu_preset_for(gpu_type, row.number("gpu_memory_gb"), assume)
    if name not in preset_names("gpus"):
        raise Unsupported(f"GPU preset {name!r} (for {gpu_type!r}) is not available: "
                          f"no presets/gpus/{name}.toml yet")
    return name


KNOWN_SYSTEMS = {
    # pattern in the row's source/notes/settings -> (cluster preset, GPU preset it holds)
    r"jean[\s_-]*zay|bloom[\s_-]*176|bigscience": ("jean-zay-a100", "a100-sxm-80gb"),
}


def known_system(row: Row, gpu: str | None) -> str | None:
    """A cluster preset for a documented training system the row names (its real links)."""
    text = " ".join(row.lower(c) for c in ("source_id", "source", "model", "notes",
                                            "other_settings", "cluster"))
    for pattern, (preset, gpu_preset) in KNOWN_SYSTEMS.items():
        if re.search(pattern, text) and gpu == gpu_preset:
            return preset
    return None


def system_cluster(preset: str, n: int, assume: Callable[[str], None]) -> ClusterSpec:
    """The named system's cluster preset, sized to ``n`` GPUs."""
    base = load_cluster(preset)
    if n % base.gpus_per_node:
        raise Unsupported(f"num_gpus={n} is not whole nodes of {preset} "
                           f"({base.gpus_per_node} GPUs per node)")
    assume(f"cluster: {preset} (the documented system of this source, its own links: "
           f"{base.intra_node.bandwidth_gbps:g} GB/s intra-node, "
           f"{base.inter_node.bandwidth_gbps:g} GB/s per GPU inter-node)")
    return base.replace(num_nodes=n // base.gpus_per_node, name=f"{preset}:{n}")


def build_cluster(gpu: str, n: int, per_node: int | None, tp: int,
                  assume: Callable[[str], None]) -> ClusterSpec:
    """parse_cluster_shorthand(f'{gpu}:{n}') semantics: the GPU's typical node size (8 for
    HGX/DGX parts, 4 for GH200), one node below that."""
    node = load_gpu(gpu).gpus_per_node
    if per_node:
        if n % per_node:
            raise Unsupported(f"num_gpus={n} is not a multiple of gpus_per_node={per_node}")
        spec = f"{gpu}:{n // per_node}x{per_node}"
    elif n > node and n % node:
        cands = [d for d in range(node, 0, -1) if n % d == 0 and d % tp == 0]
        if not cands:
            raise Unsupported(f"num_gpus={n} does not split into nodes that hold tp={tp}")
        per = cands[0]
        assume(f"{n} GPUs is not a whole number of {node}-GPU nodes: assumed {n // per} nodes x {per}")
        spec = f"{gpu}:{n // per}x{per}"
    else:
        if node != 8 and n > node:
            assume(f"nodes of {node} GPUs ({gpu}'s typical node)")
        spec = f"{gpu}:{n}"
    try:
        return parse_cluster_shorthand(spec)
    except MeshplanError as e:
        raise Unsupported(str(e)) from None
