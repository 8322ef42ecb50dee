"""--model for every command: a preset or ModelSpec file (the transformer cost model), or any model
through ingestion: ``hf:config.json``, ``module:pkg.mod:factory`` (traced on the meta device, needs
torch), or a LayerGraph .json written by ``meshplan ingest --out`` (plans without torch)."""
from __future__ import annotations

from typing import Any

from meshplan.errors import MeshplanError
from meshplan.spec.graph import LayerGraph
from meshplan.spec.model import ModelSpec

INGESTED = ("hf:", "module:")


def is_ingested(arg: str) -> bool:
    return isinstance(arg, str) and arg.startswith(INGESTED)


def _graph_file(arg: str) -> dict[str, Any] | None:
    """The parsed file when ``arg`` is a .json/.toml holding a LayerGraph (it has a 'layers' list)."""
    if not isinstance(arg, str) or not arg.endswith((".json", ".toml")):
        return None
    from meshplan.spec.io import read_data_file
    data = read_data_file(arg)
    return data if isinstance(data.get("layers"), list) else None


def load_model_arg(arg: str, *, seq_len: int | None = None) -> ModelSpec | LayerGraph:
    """A ModelSpec for presets and ModelSpec files; a LayerGraph for ingested models and graph files
    (a cli.planfile.Loaded name carries one already: a plan file's model)."""
    loaded = getattr(arg, "loaded", None)
    if isinstance(loaded, ModelSpec):  # the workload carries seq_len, as for presets below
        return loaded
    if isinstance(loaded, LayerGraph) and (seq_len is None or seq_len == loaded.sample_tokens):
        return loaded
    if is_ingested(arg):
        from meshplan.ingest import ingest  # imports torch (and transformers for hf:)
        return ingest(arg, seq_len=seq_len)
    data = _graph_file(arg)
    if data is not None:
        from meshplan.spec.base import from_dict
        data = {k: v for k, v in data.items() if k not in ("schema_version", "meta")}
        graph = from_dict(LayerGraph, data, where=arg)
        if seq_len is not None and seq_len != graph.sample_tokens:
            raise MeshplanError(f"--seq-len {seq_len}: {arg} was traced at {graph.sample_tokens} tokens per sample",
                                hint=f"drop --seq-len, or ingest again: meshplan ingest --model {graph.source} "
                                     f"--seq-len {seq_len} --out {arg}")
        return graph
    from meshplan.spec.io import load_model
    return load_model(arg)


def as_problem(model: ModelSpec | LayerGraph, global_batch: int, seq_len: int | None = None,
               lengths: Any = None, optimizer: str | None = None) -> tuple[LayerGraph, Any]:
    """(the model as a LayerGraph, the workload): the one representation every planning command
    takes. A transformer description is generated at ``seq_len`` (default: its own seq_len); a
    traced graph plans at the tokens per sample it was traced at. With ``lengths`` (a
    spec.lengths.LengthDist: --seq-len as a distribution) the workload carries it and the graph is
    generated at its longest length; a traced graph takes only packing or one length, at the length
    it was traced at (cost.lengths.check_model says why). ``optimizer``: the workload's (--optimizer;
    None: adamw)."""
    from meshplan.spec.plan import Workload
    from meshplan.spec.transformer import as_graph
    if lengths is not None:
        work = Workload.of(global_batch, lengths, optimizer or "adamw")
        if isinstance(model, LayerGraph) and model.model is None:
            from meshplan.cost.lengths import check_model
            check_model(model, work)
            if work.seq_len != model.sample_tokens:
                raise MeshplanError(f"--seq-len {lengths.text()}: its longest length {work.seq_len} is not the "
                                    f"{model.sample_tokens} tokens per sample {model.name} was traced at",
                                    hint=f"ingest it at {work.seq_len}, or give one length")
        return as_graph(model, work.seq_len), work
    s = model.sample_tokens if isinstance(model, LayerGraph) else (seq_len or model.seq_len)
    work = Workload(global_batch=global_batch, seq_len=s,  # its bounds checked before any arithmetic
                    optimizer=optimizer or "adamw")
    return as_graph(model, s), work


def graph_text(graph: LayerGraph) -> list[str]:
    """A summary of an ingested model: layers, distinct blocks, parameters, FLOPs, TP structure."""
    from meshplan.units import human_count
    blocks = graph.distinct_blocks()
    tp = graph.tp_degrees(64)
    lines = [f"model    {graph.name} ({graph.source}): {human_count(graph.params)} parameters, "
             f"{graph.num_layers} layers ({len(blocks)} distinct), task {graph.task}, "
             f"{graph.sample_tokens} tokens per sample",
             f"FLOPs    {human_count(graph.fwd_flops)} forward + {human_count(graph.bwd_flops)} backward per sample; "
             f"tensor parallel degrees allowed: {', '.join(map(str, tp))}"]
    return lines


def graph_table(graph: LayerGraph) -> str:
    from meshplan.cli.format import table
    from meshplan.units import human_count
    rows = []
    for bid, idx in graph.distinct_blocks().items():
        la = graph.layers[idx[0]]
        rows.append((bid, la.kind, len(idx), *(human_count(x) for x in (la.params, la.fwd_flops, la.bwd_flops)),
                     f"{la.saved_bytes / 2**20:.2f}", f"{la.output_bytes / 2**20:.2f}",
                     f"{la.tp_style} x{la.tp_max}" if la.tp_style != "none" else "-"))
    return table(["block", "kind", "count", "params", "fwd FLOPs", "bwd FLOPs", "saved MiB", "out MiB", "TP"],
                 rows, "llrrrrrrl")
