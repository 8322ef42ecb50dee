"""Units and sizes. Internally: bytes, FLOP, seconds, bytes/second. Counts as people read them
(`human_count`: the terminal and the HTML report print them the same way)."""
from __future__ import annotations

from collections.abc import Sequence

KiB = 1024
MiB = 1024**2
GiB = 1024**3
GB = 1e9  # decimal gigabyte; link and HBM bandwidths are quoted in GB/s
TFLOP = 1e12
US = 1e-6  # one microsecond in seconds

#: Bytes per element of each numeric format.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "tf32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0,
}


def human_count(n: float) -> str:
    """12_345_678_901 -> '12.3B' (the inverse of parse_count, to 3 significant digits)."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:g}"


def parse_count(text: str) -> float:
    """Parse '2T', '175B', '1.5M', '300k', '1e12' into a number. Raises ValueError."""
    t = text.strip().replace("_", "")
    mult = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}
    if t and t[-1].lower() in mult:
        return float(t[:-1]) * mult[t[-1].lower()]
    return float(t)


def gib_need(need: float, usable: float) -> str:
    """'NEED GiB per GPU of USABLE usable', with as many decimals (1 to 3) as it takes for a need
    over the limit not to read as equal to it (75.6 of 75.6), and ' (over by X GiB)' when over."""
    for d in (1, 2, 3):
        a, b = f"{need:.{d}f}", f"{usable:.{d}f}"
        if a != b:
            break
    text = f"{a} GiB per GPU of {b} usable"
    over = need - usable
    if over > 0:
        text += f" (over by {over:.1f} GiB)" if over >= 0.1 else f" (over by {over:.2g} GiB)"
    return text


def human_seconds(t: float) -> str:
    """Seconds in a readable unit: 1.234 s, 12.34 ms, 5.6 us (the CLI's and the report's form)."""
    if abs(t) >= 1:
        return f"{t:.3f} s"
    if abs(t) >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"


def ranges_text(xs: Sequence[int]) -> str:
    """Sorted whole numbers as runs people read: (0, 1, 2, 5, 7, 8) -> '0-2,5,7-8'."""
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)
