"""A graph neural network for meshplan's ingestion and runtime tests (no downloaded data, random
init): node classification on a fixed random graph. ``module:gnn:make_gnn`` (2048 nodes, 128 input
features, width 256, 8 blocks, 16 classes) or ``module:gnn:make_gnn_tiny`` (32 nodes, 16 features,
width 32, 4 blocks, 4 classes: trains on a CPU in seconds), with ``tests/data/modules`` on
PYTHONPATH.

The graph is generated deterministically (Python's ``random.Random(seed)``, independent of torch's
RNG): every node links to ``degree`` random others, edges undirected, self-loops added, and the
adjacency normalised symmetrically as in Kipf & Welling's GCN, ``D^-1/2 (A + I) D^-1/2``, held
dense in a buffer (``adj``, not saved in checkpoints). A sample is one signal on the graph: node
features ``[nodes, features]``; a batch ``[b, nodes, features]`` is b signals on the same graph,
so data parallelism splits signals, not the graph.

The blocks are GIN/GCN-style message passing with a pre-norm residual MLP:
``h = h + fc2(gelu(fc1(norm(adj @ h))))``, one ``nn.ModuleList`` (``layers``). Ingestion's units
are ``encoder`` (input projection), the blocks (kind "block"), ``norm`` and ``head``; the forward is
a plain sequence of them (the runtime may pipeline it; every stage keeps the root's ``adj``).
``fc1``/``fc2`` are a column -> row pair for tensor parallelism (``ingest/tp.py``): aggregation and
norm run on the replicated input, the MLP is split.

The loss is cross-entropy per node against a label computed from the input: the argmax over the
first ``classes`` features of the neighbourhood mean ``adj @ x`` (so the model has to pass
messages to learn it).
"""
from __future__ import annotations

import functools
import random

import torch
import torch.nn.functional as F
from torch import nn

try:  # the ViT's MLP (fc1 -> GELU -> fc2: a column/row pair tensor parallelism splits)
    from .vit import Mlp
except ImportError:  # loaded as a top-level module (the folder on sys.path, as the tests do)
    from vit import Mlp

TASK = "classification"
SEED = 1234


@functools.lru_cache(maxsize=8)
def graph(nodes: int, degree: int = 4, seed: int = SEED) -> torch.Tensor:
    """The normalised dense adjacency ``D^-1/2 (A + I) D^-1/2`` [nodes, nodes], float32, on CPU."""
    rng = random.Random(seed)
    nbrs = [{i} for i in range(nodes)]  # self-loops
    for i in range(nodes):
        for j in rng.sample(range(nodes), min(degree, nodes)):
            nbrs[i].add(j)
            nbrs[j].add(i)
    deg = [len(s) for s in nbrs]
    rows = [[(1.0 / (deg[i] * deg[j]) ** 0.5 if j in nbrs[i] else 0.0) for j in range(nodes)] for i in range(nodes)]
    return torch.tensor(rows, dtype=torch.float32, device="cpu")


class GraphBlock(nn.Module):
    """One round of message passing: aggregate the neighbours (``adj @ h``), then a residual MLP."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, hidden)

    def forward(self, h: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(torch.matmul(adj, h)))


class GNN(nn.Module):
    def __init__(self, nodes: int = 2048, features: int = 128, dim: int = 256, depth: int = 8,
                 num_classes: int = 16, degree: int = 8) -> None:
        super().__init__()
        self.nodes, self.features, self.degree = nodes, features, degree
        self.SAMPLE_TOKENS = nodes  # nodes per sample (tokens/s in the metrics counts nodes)
        self.register_buffer("adj", graph(nodes, degree).to(torch.get_default_device()), persistent=False)
        self.encoder = nn.Linear(features, dim)
        self.layers = nn.ModuleList(GraphBlock(dim, 2 * dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        for block in self.layers:
            h = block(h, self.adj)
        return self.head(self.norm(h))  # [b, nodes, classes]

    def example_inputs(self, batch_size: int, seq_len: int | None = None) -> torch.Tensor:
        return torch.randn(batch_size, self.nodes, self.features)

    def loss(self, outputs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return loss(outputs, x, self.degree)


def make_gnn() -> GNN:
    return GNN()


def make_gnn_tiny() -> GNN:
    """32 nodes (degree 4), 16 features, width 32, 4 blocks (MLP 64), 4 classes."""
    return GNN(nodes=32, features=16, dim=32, depth=4, num_classes=4, degree=4)


def loss(outputs: torch.Tensor, x: torch.Tensor, degree: int = 4) -> torch.Tensor:
    classes = outputs.shape[-1]
    adj = graph(x.shape[-2], degree).to(device=x.device, dtype=x.dtype)
    labels = torch.matmul(adj, x)[..., :classes].argmax(-1)
    return F.cross_entropy(outputs.float().reshape(-1, classes), labels.reshape(-1))
