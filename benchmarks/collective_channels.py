"""Issue 26: does NCCL's per-size channel (and thread) count, alone or with its LL/LL128 protocol
choice, explain the collective rows the model over-predicts at 1-32 MiB?

NCCL lowers the channels, then the threads, of a collective whose bytes do not give every thread of
every channel its threshold of work (NVIDIA/nccl, the same rule from v2.7.5 to v2.27.7):

- enqueue.cc (v2.7.5 getAlgoInfo, commit 01afd20, line 283; v2.18.3 getAlgoInfo, commit ea38312,
  line 1207; v2.27.7 topoGetAlgoInfo, commit 593de54, lines 1849-1861):
  ``while (nBytes < nc*nt*threadThreshold) { if (nc >= 2) nc--; else if ((nt % 128) == 0) nt /= 2;
  else break; }`` with nc = the communicator's channels, nt = maxThreads[algo][proto];
- thresholds (src/include/comm.h): NCCL_LL_THREAD_THRESHOLD 8, NCCL_LL128_THREAD_THRESHOLD 8,
  NCCL_SIMPLE_THREAD_THRESHOLD 64; graph/tuning.cc (ncclTopoTuneModel): the same for every algorithm,
  and ``threadThresholds[NCCL_ALGO_RING][NCCL_PROTO_LL] *= nRanks`` (only ring/LL is multiplied; AWS's
  p4d log of data/collectives_dev.csv prints "threadThresholds 8/8/64 | 128/8/64" for 16 ranks);
- maxThreads (devcomm.h / device.h): NCCL_SIMPLE_MAX_NTHREADS 512, NCCL_LL_MAX_NTHREADS 512,
  NCCL_LL128_MAX_NTHREADS 640.

A collective's bandwidth scales with the channels (and threads) in use: nc x nt of the
communicator's nc_max x nt_max, each channel at its share of the link (NCCL tuning.cc: busBw =
nChannels x the per-channel bandwidth). nc_max (every protocol, every variant): the channels the
row's log states (AWS p4d: 8; Jean Zay: 2), else 32 (MAXCHANNELS up to v2.18: the most any
communicator had then, so the largest effect the rule can have there); 64 (MAXCHANNELS of later
versions) is run too.

Run: PYTHONPATH=src python benchmarks/collective_channels.py
"""
from __future__ import annotations

import statistics

import numpy as np

from meshplan.cost import comm
from meshplan.cost.comm import NCCL_BASE_US, NCCL_BW_FACTOR, Group, hop_latency, tree_correction
from meshplan.units import US
from meshplan.validate import collectives as vc

THREAD_THRESHOLD = {"ll": 8, "ll128": 8, "simple": 64}
MAX_THREADS = {"ll": 512, "ll128": 640, "simple": 512}
LOG_CHANNELS = {"awseks": 8, "bs-jz": 2}  # "8 coll channels" / "2 coll channels" in the rows' NCCL logs
MAXCHANNELS = 32


def nccl_channels(nbytes: float, algo: str, proto: str, nranks: int, nc_max: int) -> tuple[int, int]:
    """(channels, threads) NCCL runs ``nbytes`` with (the loop above, exactly)."""
    thr = THREAD_THRESHOLD[proto] * (nranks if (algo, proto) == ("ring", "ll") else 1)
    nc, nt = nc_max, MAX_THREADS[proto]
    while nbytes < nc * nt * thr:
        if nc >= 2:
            nc -= 1
        elif nt % 128 == 0:
            nt //= 2
        else:
            break
    return nc, nt


def share(nbytes: float, algo: str, proto: str, nranks: int, nc_max: int) -> float:
    nc, nt = nccl_channels(nbytes, algo, proto, nranks, nc_max)
    return nc * nt / (nc_max * MAX_THREADS[proto])


STATE = {"nc_max": MAXCHANNELS, "channels": False, "protocols": ("simple",), "tree_protocols": ("simple",),
         "row_nc": None}


def row_channels(row: vc.CollectiveRow, default: int) -> int:
    """The row's communicator channels: its log's, else ``default``."""
    return next((v for k, v in LOG_CHANNELS.items() if row.row_id.startswith(k)), default)


_predict = vc.predict_busbw


def predict_busbw(row, efficiency=None):
    """vc.predict_busbw with the row's channel count in force (score() prices every row through it)."""
    STATE["row_nc"] = row_channels(row, STATE["nc_max"])
    try:
        return _predict(row, efficiency)
    finally:
        STATE["row_nc"] = None


def nc_max() -> int:
    return STATE["row_nc"] or STATE["nc_max"]


def _ring(self: Group, size, passes):
    n = float(np.maximum(self.n, 1))
    m = n - 1
    size = float(size)
    if n <= 1 or size <= 0:
        return 0.0
    across = bool(self.across_nodes)
    best = np.inf
    for p in STATE["protocols"]:
        key = ("ring", p)
        if p == "ll128" and across:
            continue
        hop = hop_latency(self.latency_s, "net" if across else "nvlink", key)
        if p == "simple":
            hop = self.latency_s
        f = share(size, "ring", p, int(n), nc_max()) if STATE["channels"] else 1.0
        t = passes * m / n * size / (float(self.bytes_per_s) * NCCL_BW_FACTOR[key] * f) + passes * m * hop \
            + NCCL_BASE_US[key] * US
        best = min(best, float(t))
    return best


def _tree(self: Group, size):
    n = float(np.maximum(self.n, 1))
    c = max(float(self.per_node), 1.0)
    k = max(round(n / c), 1.0)
    size = float(size)
    ib = float(self.bytes_per_s if self.intra_bps is None else self.intra_bps)
    net = (1.0 if k <= 2 else 2.0) * size / float(self.bytes_per_s)
    chain = size / ib if c > 1 else 0.0
    best = np.inf
    for p in STATE["tree_protocols"]:
        key = ("tree", p)
        lat = 2.0 * ((c - 1) * hop_latency(self.intra_lat, "nvlink", key) + np.ceil(np.log2(k))
                     * hop_latency(self.latency_s, "net", key))
        f = share(size, "tree", p, int(n), nc_max()) if STATE["channels"] else 1.0
        bw = NCCL_BW_FACTOR[key] * float(tree_correction(p, size)) * f
        best = min(best, float(max(net, chain) / bw + lat + NCCL_BASE_US[key] * US))
    return best


def run(label: str) -> dict:
    rows = vc.load_rows()
    scored = vc.score(rows)
    s = vc.summarize(scored)
    mid = [x for x in scored if x.row.scope == "modelled" and x.row.nbytes <= 32 * 2 ** 20]
    print(f"{label:44s} mean {s['mean_abs_error_pct']:5.1f}  median {s['median_abs_error_pct']:5.1f}  "
          f"loso {s['loso_mean_abs_error_pct']:5.1f}  within15 {s['rows_within_15pct']:2d}/{s['modelled_rows']}  "
          f">=256MiB {s['large_mean_abs_error_pct']:4.1f}  <=32MiB "
          f"{statistics.fmean(abs(x.error_pct) for x in mid):5.1f}")
    return {x.row.row_id: x.error_pct for x in scored if x.row.scope == "modelled"}


def main() -> None:
    rows = [r for r in vc.load_rows() if r.scope == "modelled" and r.nbytes <= 32 * 2 ** 20]
    print("channels x threads NCCL runs each <= 32 MiB row with (of nc_max x nt_max):")
    for r in rows:
        ncm = row_channels(r, MAXCHANNELS)
        cells = []
        for algo, proto in (("ring", "simple"), ("ring", "ll"), ("ring", "ll128"), ("tree", "simple"), ("tree", "ll")):
            nc, nt = nccl_channels(r.nbytes, algo, proto, r.ranks, ncm)
            cells.append(f"{algo}/{proto} {nc}x{nt}")
        print(f"  {r.row_id:16s} {r.nbytes / 2 ** 20:4.0f} MiB {r.ranks:2d} ranks nc_max {ncm:2d}: " + ", ".join(cells))
    print()
    base = run("baseline (Simple, all channels)")
    orig_ring, orig_tree = Group._ring, Group._tree
    Group._ring, Group._tree, vc.predict_busbw = _ring, _tree, predict_busbw
    try:
        same = run("re-implemented baseline (check)")
        assert all(abs(same[k] - base[k]) < 1e-6 for k in base), "re-implementation differs from cost.comm"
        STATE["channels"] = True
        ch = run("+ NCCL channel/thread count (nc_max 32)")
        STATE["nc_max"] = 64
        ch64 = run("+ NCCL channel/thread count (nc_max 64)")
        STATE["nc_max"] = MAXCHANNELS
        STATE["channels"] = False
        STATE["protocols"], STATE["tree_protocols"] = ("ll", "ll128", "simple"), ("ll", "simple")
        pr = run("LL/LL128/Simple by least time")
        STATE["channels"] = True
        both = run("LL/LL128/Simple + channel/thread count")
        for ncm in (8, 16, 64):
            STATE["nc_max"] = ncm
            run(f"  the same, nc_max {ncm}")
        STATE["nc_max"] = MAXCHANNELS
    finally:
        Group._ring, Group._tree, vc.predict_busbw = orig_ring, orig_tree, _predict
    print("\nper row, error % (baseline / channels nc_max 32 / channels nc_max 64 / protocols / both), rows <= 32 MiB:")
    for r in rows:
        k = r.row_id
        print(f"  {k:16s} {base[k]:+7.1f} {ch[k]:+7.1f} {ch64[k]:+7.1f} {pr[k]:+7.1f} {both[k]:+7.1f}")


if __name__ == "__main__":
    assert comm.PROTOCOLS == ("simple",)
    main()
