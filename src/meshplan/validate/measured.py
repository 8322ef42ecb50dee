"""The measured values of a published run: the step time (with the source's own formula), the peak
memory, and whether the run fit (its status cell)."""
from __future__ import annotations

import re
from collections.abc import Callable

from meshplan.errors import MeshplanError
from meshplan.spec.io import load_gpu
from meshplan.spec.model import ModelSpec
from meshplan.units import GiB
from meshplan.validate.formulas import (
    flops_bloom,
    flops_kor22_hardware,
    flops_kor22_model,
    flops_meg21,
    flops_megatron_no_recompute,
    flops_mosaic,
    flops_palm,
    flops_tt,
    step_time_from_flops,
    step_time_from_samples,
    step_time_from_tokens_per_gpu,
    step_time_from_tokens_total,
    step_time_from_utilization,
)
from meshplan.validate.frameworks import FRAMEWORK_LABEL
from meshplan.validate.rows import Row


def _peak_from_basis(text: str | None) -> float | None:
    """'A100 bf16 312' -> 312: the last number not glued to letters (A100, bf16 are skipped)."""
    if not text:
        return None
    nums = re.findall(r"(?<![A-Za-z\d.])(\d+(?:\.\d+)?)(?![A-Za-z\d])", text)
    vals = [float(x) for x in nums if float(x) >= 20]
    return vals[-1] if vals else None


#: Frameworks whose MFU divides by the peak of the run's own precision (Composer's
#: SpeedMonitor GPU_AVAILABLE_FLOPS: amp_fp8 -> the fp8 peak, 1979 TFLOP/s on H100 SXM);
#: the others (torchtitan, Megatron) quote the 16-bit peak whatever the precision.
OWN_PRECISION_PEAK = ("llm-foundry",)


def default_peak_tflops(gpu: str | None, gpu_type: str, precision: str,
                        fw: str = "unknown") -> tuple[float | None, str]:
    """The dense peak the row's source divided by, when the row does not state it."""
    t = gpu_type.lower()
    own = precision == "fp8" and fw in OWN_PRECISION_PEAK
    if "a100" in t:
        return 312.0, "A100 dense bf16/fp16 312 TFLOP/s"
    if "h100" in t or "h200" in t:  # also GH200: the H100 GPU of the superchip
        kind = "PCIe" if "pcie" in t else ("NVL" if "nvl" in t else "SXM")
        bf16, fp8 = {"PCIe": (756.0, 1513.0), "NVL": (835.0, 1671.0), "SXM": (989.0, 1979.0)}[kind]
        name = "GH200" if "gh200" in t else ("H200" if "h200" in t else "H100")
        if own:
            return fp8, f"{name} {kind} dense fp8 {fp8:g} TFLOP/s ({FRAMEWORK_LABEL[fw]} uses the fp8 peak)"
        return bf16, f"{name} {kind} dense bf16 {bf16:g} TFLOP/s"
    if gpu:
        try:
            g = load_gpu(gpu)
            prec = precision if (own or precision != "fp8") else "bf16"
            p = g.peak(prec) / 1e12
            return p, f"{gpu} preset dense {prec} {p:g} TFLOP/s"
        except MeshplanError:
            pass
    return None, ""


OK_STATUS = re.compile(r"^(ok|success|succeeded|completed|done|trained)\b")
_NO_OOM = re.compile(r"\bno[\s_-]*oom\b|oom[\s_-]*free|without[\s_-]*oom")
_GPU_OOM = re.compile(r"(?<![a-z])oom(?![a-z])|out[\s_-]*of[\s_-]*memory|memory[\s_-]*limit[\s_-]*exceeded"
                      r"|exceeded[\s_-]*(gpu[\s_-]*)?memory")
_HOST_OOM = re.compile(r"\b(host|cpu|system)[\s_-]*(oom|out[\s_-]*of[\s_-]*memory)|oom[\s_-]*killer")


def did_not_fit(status: str) -> bool:
    """A `status` cell that says the run ran out of GPU memory ('oom', 'failed (OOM)', 'CUDA out
    of memory', 'memory limit exceeded'); not 'ok (no OOM)', nor a host OOM-killer."""
    t = status.strip().lower()
    if OK_STATUS.match(t) or _NO_OOM.search(t) or _HOST_OOM.search(t):
        return False
    return bool(_GPU_OOM.search(t))


def measure_step_time(row: Row, *, B: int | None, s: int | None, n: int | None,
                      model: ModelSpec | None, recompute: str, fw: str, gpu: str | None,
                      precision: str, assume: Callable[[str], None]) -> tuple[float | None, str]:
    """(step time in s, how it was obtained) following the README's per-source formulas."""
    t = row.positive_number("reported_step_time_s")
    if t is not None:
        return t, "reported_step_time_s"
    tpg = row.positive_number("reported_tokens_per_s_per_gpu")
    if tpg is not None and B and s and n:
        return (step_time_from_tokens_per_gpu(B, s, n, tpg),
                "reported_tokens_per_s_per_gpu: t = B*s/(n*tok/s/GPU)")
    tpt = row.positive_number("reported_tokens_per_s_total")
    if tpt is not None and B and s:
        return (step_time_from_tokens_total(B, s, tpt),
                "reported_tokens_per_s_total: t = B*s/(tok/s)")
    sps = row.positive_number("reported_samples_per_s")
    if sps is not None and B:
        return step_time_from_samples(B, sps), "reported_samples_per_s: t = B/(seq/s)"

    # FLOP-based: need the shapes.
    fid = (row.text("metric_formula_id") or "").upper()
    kind = row.lower("tflops_kind")
    L, h, V = row.integer("num_layers"), row.integer("hidden_size"), row.integer("vocab_size")
    if model is not None:
        L, h, V = model.num_layers, model.hidden_size, model.vocab_size
    if not (B and s and n and L and h and V):
        return None, ""
    h_attn = model.q_dim if model is not None else h

    def flops(hardware: bool) -> tuple[float | None, str]:
        if fid == "F_MEG21":
            if hardware:
                return flops_meg21(B, s, L, h, V), "F_MEG21 (SC'21 Eq. 3)"
            return (flops_megatron_no_recompute(B, s, L, h, V),
                    "F_MEG21 without recompute (72 B s l h^2 ...)")
        if fid == "F_BLOOM":
            rec = recompute != "none" if hardware else False
            return (flops_bloom(B, s, L, h, V, rec),
                    f"F_BLOOM (Megatron-DeepSpeed, factor {4 if rec else 3})")
        if fid == "F_KOR22":
            if hardware:
                return flops_kor22_hardware(B, s, L, h, V, recompute), "F_KOR22 hardware FLOPs"
            return flops_kor22_model(B, s, L, h, V), "F_KOR22 model FLOPs"
        if model is None:
            return None, ""
        if fid == "F_TT":
            return flops_tt(B, s, L, h_attn, model.num_params()), "F_TT (6N + 12 l h s per token)"
        if fid == "F_MOSAIC":
            hw = hardware and recompute != "none"
            return (flops_mosaic(B, s, L, h_attn, model.num_params(), hw),
                    f"F_MOSAIC ({'8N s + 16 l h s^2' if hw else '6N s + 12 l h s^2'})")
        # Unknown formula id: fall back on what the row says.
        if hardware and recompute != "none":
            assume(f"metric formula {fid or 'not stated'}: hardware FLOPs taken as "
                   "Megatron Eq. 3 style")
            return (flops_bloom(B, s, L, h, V, recompute != "none"),
                    "Eq. 3 style hardware FLOPs (fallback)")
        assume(f"metric formula {fid or 'not stated'}: model FLOPs taken as "
               "6N + 12 l h s per token (PaLM)")
        return (flops_palm(B, s, L, h_attn, model.num_active_params()),
                "6N + 12 l h s per token (fallback)")

    tfl = row.positive_number("reported_tflops_per_gpu")
    src = "reported_tflops_per_gpu"
    if tfl is None:
        agg = row.positive_number("reported_aggregate_pflops")
        if agg is not None:
            tfl, src = agg * 1e3 / n, "reported_aggregate_pflops/n"
    if tfl is not None:
        hardware = "hardware" in kind or (fid in ("F_MEG21", "F_BLOOM") and "model" not in kind)
        F, how = flops(hardware)
        if F is not None:
            return step_time_from_flops(F, n, tfl), f"{src} via {how}: t = F/(n*TFLOP/s)"

    peak = _peak_from_basis(row.text("peak_tflops_basis"))
    peak_how = "peak_tflops_basis"
    for col, hardware in (("reported_mfu_pct", False), ("reported_hfu_pct", True)):
        u = row.positive_number(col)
        if u is None:
            continue
        if peak is None:
            peak, peak_how = default_peak_tflops(gpu, row.text("gpu_type") or "", precision, fw)
            if peak is None:
                return None, ""
            assume(f"peak_tflops_basis not stated: assumed {peak_how}")
        if u <= 1.0:
            assume(f"{col}={u} read as a fraction, not a percentage")
            u *= 100.0
        F, how = flops(hardware)
        if F is not None:
            return (step_time_from_utilization(F, n, peak, u),
                    f"{col} via {how}, peak {peak:g} TFLOP/s: t = F/(n*peak*util)")
    return None, ""


def measure_peak_mem(row: Row, assume: Callable[[str], None]) -> float | None:
    v = row.positive_number("reported_peak_mem_gib")
    if v is not None:
        return v
    v = row.positive_number("reported_peak_mem_gb")
    if v is not None:
        assume("reported_peak_mem_gb read as decimal GB and converted to GiB")
        return v * 1e9 / GiB
    return None


#: The explicit label a row gives its measured memory ('memory measured: allocated' in notes):
#: allocated = torch.cuda.max_memory_allocated (live tensors), reserved = max_memory_reserved
#: (the caching allocator's segments), nvidia-smi = the device's used memory (also the CUDA
#: context, NCCL's and other libraries' buffers).
_MEMORY_KIND = re.compile(r"memory[\s_-]*measured\s*[:=]\s*(allocated|reserved|nvidia[\s_-]?smi)")
MEMORY_KINDS = ("allocated", "reserved", "nvidia-smi")


def memory_kind(row: Row) -> str | None:
    """What the row's measured memory is: 'allocated', 'reserved' or 'nvidia-smi' as its
    other_settings/notes/uncertain_fields label it ('memory measured: reserved'); without that
    label, 'nvidia-smi' where the text names nvidia-smi, else None (not stated). A label naming
    anything else is an error the row's author must fix."""
    text = " ".join(row.lower(c) for c in ("other_settings", "notes", "uncertain_fields"))
    m = _MEMORY_KIND.search(text)
    if m:
        kind = m.group(1)
        return "nvidia-smi" if kind.startswith("nvidia") else kind
    bad = re.search(r"memory[\s_-]*measured\s*[:=]\s*([a-z_-]+)", text)
    if bad:
        raise MeshplanError(f"row {row.text('row_id') or '?'}: 'memory measured: {bad.group(1)}' is not a "
                            f"memory kind; write one of {', '.join(MEMORY_KINDS)}")
    if "nvidia-smi" in text or "nvidia_smi" in text:
        return "nvidia-smi"
    return None


def memory_by_nvidia_smi(row: Row) -> bool:
    """Whether the row says its measured memory is nvidia-smi's: that also holds memory outside
    torch's allocator (NCCL's own buffers, other libraries), which the cost model does not
    predict, so calibration reports such rows but does not fit to them."""
    return memory_kind(row) == "nvidia-smi"


def fit_from_status(run_status: str, how: str) -> tuple[bool | None, str]:
    """(measured_fits, measured_from) from the row's status cell: False for a run that ran out of
    GPU memory, None for another failure, True otherwise; ``how`` says so when it is blank."""
    if did_not_fit(run_status):
        return False, how or f"none (status={run_status}: the run did not fit)"
    if not OK_STATUS.match(run_status):
        return None, how or f"none (status={run_status})"
    return True, how
