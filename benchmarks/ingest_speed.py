"""How fast, and how lean, is ingestion? Llama 3 70B from its Hugging Face config, on the meta device.

The config dict is written from the llama3-70b preset (80 layers, h 8192, 64 heads / 8 kv heads,
SwiGLU 28672, vocabulary 128256, untied) at 8192 tokens. Everything happens in this one process,
as for a user's first `ingest` call: importing torch and transformers, building the model on the
meta device, tracing forward + loss + backward, assembling the LayerGraph; then a second, warm
ingest of the same config. Peak memory is the process's maximum resident set size
(resource.getrusage). Targets (issue 5): under 30 s and under 2 GB on a 2-core machine.

Writes benchmarks/results/ingest_speed.json and prints a summary.
Run: PYTHONPATH=src .venv/bin/python benchmarks/ingest_speed.py
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _evaluators import commit  # noqa: E402

from meshplan.spec.io import load_model  # noqa: E402

TARGET_SECONDS = 30.0
TARGET_RSS_BYTES = 2 * 1024**3


def llama_config(preset: str = "llama3-70b") -> dict:
    """The Hugging Face config.json of a Llama-shaped preset."""
    m = load_model(preset)
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": m.hidden_size,
            "intermediate_size": m.ffn_hidden_size, "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.kv_heads,
            "vocab_size": m.vocab_size, "max_position_embeddings": m.seq_len, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": m.tied_embeddings}


def peak_rss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024 if sys.platform != "darwin" else kb  # Linux reports KiB, macOS bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-70b")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "ingest_speed.json")
    args = ap.parse_args(argv)

    spec = load_model(args.preset)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(llama_config(args.preset)))
        t0 = time.perf_counter()
        import torch  # noqa: F401 - the imports are part of a first call's cost
        import transformers  # noqa: F401

        from meshplan.ingest import ingest
        t_import = time.perf_counter() - t0
        t1 = time.perf_counter()
        graph = ingest(f"hf:{path}", seq_len=args.seq_len, dtype=args.dtype)
        t_first = time.perf_counter() - t1
        total = time.perf_counter() - t0
        t2 = time.perf_counter()
        ingest(f"hf:{path}", seq_len=args.seq_len, dtype=args.dtype)
        t_warm = time.perf_counter() - t2
    rss = peak_rss_bytes()
    blocks = [x for x in graph.layers if x.kind == "block"]
    result = {
        "model": args.preset, "seq_len": args.seq_len, "dtype": args.dtype,
        "seconds_total": round(total, 3), "seconds_imports": round(t_import, 3),
        "seconds_ingest_first": round(t_first, 3), "seconds_ingest_warm": round(t_warm, 3),
        "peak_rss_mb": round(rss / 2**20, 1),
        "target_seconds": TARGET_SECONDS, "target_peak_rss_mb": TARGET_RSS_BYTES / 2**20,
        "meets_targets": total < TARGET_SECONDS and rss < TARGET_RSS_BYTES,
        "layers": graph.num_layers, "blocks": len(blocks),
        "blocks_measured": sum(1 for x in blocks if x.extra.get("measured") == 1.0),
        "params": graph.params, "params_analytical": spec.num_params(),
        "step_flops_per_sample": graph.fwd_flops + graph.bwd_flops,
        "block_saved_bytes_per_sample": blocks[1].saved_bytes if len(blocks) > 1 else None,
        "cpus": os.cpu_count(), "torch": sys.modules["torch"].__version__,
        "transformers": sys.modules["transformers"].__version__,
        "python": platform.python_version(), "machine": platform.platform(), "commit": commit(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"ingest {args.preset} ({graph.num_layers} layers, {graph.params / 1e9:.2f}B params, seq {args.seq_len}, "
          f"{args.dtype}): {total:.2f} s total ({t_import:.2f} s imports + {t_first:.2f} s ingest; warm "
          f"{t_warm:.2f} s), peak RSS {rss / 2**20:.0f} MiB on {os.cpu_count()} CPUs -> "
          f"{'meets' if result['meets_targets'] else 'MISSES'} the targets (< {TARGET_SECONDS:.0f} s, < 2 GB); "
          f"{args.out}")
    return 0 if result["meets_targets"] else 1


if __name__ == "__main__":
    sys.exit(main())
