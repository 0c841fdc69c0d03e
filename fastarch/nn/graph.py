"""Graph networks of guide 001, drop-in: ``GraphConvLayer``/``GCN`` and ``GATLayer``/``GAT``.

Every module takes the guide's dense adjacency ``adj_matrix`` (N, N) — or a ``torch.sparse`` one — or,
instead, a sparse ``edge_index`` (2, E) (row 0 = source j, row 1 = target i: node i aggregates from j, i.e.
the dense ``adj[i, j]``) with optional ``edge_weight`` (E,). The sparse path needs O(N + E) memory
(gather / ``index_add`` / ``scatter_reduce``), so graphs of 100k nodes run on a CPU; it equals the dense path.

Dense GAT no longer builds the guide's (N, N, 2F) concatenation: ``[h_i, h_j] . a = a_1 . h_i + a_2 . h_j``,
so the scores are an outer sum of two (N,) vectors. Duplicate edges in ``edge_index`` are merged (GCN sums
their weights, as a dense adjacency would; GAT keeps one), and a node without in-edges gets, as in the
guide's dense code, a uniform average over all nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._models_common import check_input
from .linear import Linear

__all__ = ["GraphConvLayer", "GCN", "GATLayer", "GAT", "edge_index_to_dense", "gcn_normalize"]


def _check_graph(X, adj_matrix, edge_index, edge_weight, owner: str) -> int:
    check_input("X", X, ndim=2, owner=owner)
    n = X.shape[0]
    if (adj_matrix is None) == (edge_index is None):
        raise ValueError(f"{owner}: pass exactly one of 'adj_matrix' (N, N) and 'edge_index' (2, E)")
    if adj_matrix is not None:
        if not isinstance(adj_matrix, torch.Tensor) or adj_matrix.shape != (n, n):
            got = tuple(adj_matrix.shape) if isinstance(adj_matrix, torch.Tensor) else type(adj_matrix).__name__
            raise ValueError(f"{owner}: argument 'adj_matrix' must be a ({n}, {n}) tensor, got {got}")
    else:
        if not isinstance(edge_index, torch.Tensor) or edge_index.dim() != 2 or edge_index.shape[0] != 2:
            got = tuple(edge_index.shape) if isinstance(edge_index, torch.Tensor) else type(edge_index).__name__
            raise ValueError(f"{owner}: argument 'edge_index' must be a (2, E) integer tensor, got {got}")
        if edge_index.is_floating_point():
            raise TypeError(f"{owner}: argument 'edge_index' must hold integer node ids, got {edge_index.dtype}")
        if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= n):
            raise ValueError(f"{owner}: argument 'edge_index' has node ids outside [0, {n})")
        if edge_weight is not None and (edge_weight.dim() != 1 or edge_weight.shape[0] != edge_index.shape[1]):
            raise ValueError(f"{owner}: argument 'edge_weight' must be ({edge_index.shape[1]},), "
                             f"got {tuple(edge_weight.shape)}")
    return n


def edge_index_to_dense(edge_index: torch.Tensor, num_nodes: int, edge_weight: torch.Tensor | None = None,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense adjacency with ``adj[target, source] = weight`` (duplicates summed)."""
    adj = torch.zeros(num_nodes, num_nodes, dtype=dtype, device=edge_index.device)
    w = edge_weight.to(dtype) if edge_weight is not None else torch.ones(edge_index.shape[1], dtype=dtype,
                                                                         device=edge_index.device)
    return adj.index_put_((edge_index[1], edge_index[0]), w, accumulate=True)


def _coalesce(edge_index: torch.Tensor, n: int, edge_weight: torch.Tensor | None, reduce_sum: bool):
    key = edge_index[1].long() * n + edge_index[0].long()
    uniq, inv = torch.unique(key, return_inverse=True)
    dst, src = uniq // n, uniq % n
    if edge_weight is None:
        w = None
    elif reduce_sum:
        w = torch.zeros(uniq.shape[0], dtype=edge_weight.dtype, device=edge_weight.device).index_add_(0, inv,
                                                                                                   edge_weight)
    else:
        w = torch.zeros(uniq.shape[0], dtype=edge_weight.dtype, device=edge_weight.device).scatter_(0, inv,
                                                                                                edge_weight)
    return src, dst, w


def _aggregate(x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, w: torch.Tensor | None, n: int) -> torch.Tensor:
    """out[i] = sum over edges (j -> i) of w * x[j]."""
    msg = x.index_select(0, src)
    if w is not None:
        msg = msg * w.to(x.dtype).unsqueeze(1)
    return torch.zeros(n, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, dst, msg)


class GraphConvLayer(nn.Module):
    """out = linear(A @ X). forward(X (N, in), adj_matrix (N, N) | None, *, edge_index (2, E), edge_weight (E,))
    -> (N, out). The cheaper of (A X) W^T and A (X W^T) is used (equal up to rounding)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.linear = Linear(in_features, out_features)

    def forward(self, X, adj_matrix=None, *, edge_index=None, edge_weight=None):
        n = _check_graph(X, adj_matrix, edge_index, edge_weight, "GraphConvLayer")
        if X.shape[1] != self.in_features:
            raise ValueError(f"GraphConvLayer: argument 'X' must have {self.in_features} features, "
                             f"got shape {tuple(X.shape)}")
        transform_first = self.out_features < self.in_features
        h = F.linear(X, self.linear.weight) if transform_first else X
        if adj_matrix is not None:
            agg = torch.sparse.mm(adj_matrix, h) if adj_matrix.is_sparse else adj_matrix.to(h.dtype) @ h
        else:
            agg = _aggregate(h, edge_index[0], edge_index[1], edge_weight, n)
        return agg + self.linear.bias if transform_first else self.linear(agg)


def gcn_normalize(num_nodes: int, edge_index: torch.Tensor, edge_weight: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.float32):
    """Sparse D^-1/2 (A + I) D^-1/2 as (src, dst, weight) edge lists, A[i, j] = weight of edge j -> i."""
    if edge_weight is None:  # duplicates count, as they would when summed into a dense adjacency
        edge_weight = torch.ones(edge_index.shape[1], dtype=dtype, device=edge_index.device)
    src, dst, w = _coalesce(edge_index, num_nodes, edge_weight.to(dtype), reduce_sum=True)
    loop = torch.arange(num_nodes, device=src.device)
    src, dst = torch.cat([src, loop]), torch.cat([dst, loop])
    w = torch.cat([w, torch.ones(num_nodes, dtype=dtype, device=w.device)])
    deg = torch.zeros(num_nodes, dtype=dtype, device=w.device).index_add_(0, dst, w)
    dinv = deg.pow(-0.5)
    dinv = torch.where(torch.isinf(dinv), torch.zeros_like(dinv), dinv)
    return src, dst, dinv[dst] * w * dinv[src]


class GCN(nn.Module):
    """GCN of guide 001: D^-1/2 (A + I) D^-1/2 normalisation, [GraphConv -> ReLU -> Dropout]* -> GraphConv.
    forward(X (N, in), adj_matrix (N, N) | None, *, edge_index (2, E), edge_weight (E,)) -> (N, num_classes)."""

    def __init__(self, in_features: int, hidden_dims: Sequence[int], num_classes: int, dropout: float = 0.5):
        super().__init__()
        layers: list[nn.Module] = []
        prev = in_features
        for h in hidden_dims:
            layers += [GraphConvLayer(prev, h), nn.ReLU(), nn.Dropout(dropout)]
            prev = h
        layers.append(GraphConvLayer(prev, num_classes))
        self.layers = nn.ModuleList(layers)

    def forward(self, X, adj_matrix=None, *, edge_index=None, edge_weight=None):
        n = _check_graph(X, adj_matrix, edge_index, edge_weight, "GCN")
        if adj_matrix is not None:
            a = adj_matrix.to_dense() if adj_matrix.is_sparse else adj_matrix
            a = a + torch.eye(n, device=a.device, dtype=a.dtype)
            d = a.sum(dim=1).pow(-0.5)
            d = torch.where(torch.isinf(d), torch.zeros_like(d), d)
            adj = d[:, None] * a * d[None, :]
            kw: dict = {"adj_matrix": adj}
        else:
            src, dst, w = gcn_normalize(n, edge_index, edge_weight, X.dtype)
            kw = {"edge_index": torch.stack([src, dst]), "edge_weight": w}
        x = X
        for layer in self.layers:
            x = layer(x, **kw) if isinstance(layer, GraphConvLayer) else layer(x)
        return x


class GATLayer(nn.Module):
    """Graph attention layer of guide 001 (one score per node pair from the concatenated heads, as there).

    forward(X (N, in), adj_matrix (N, N) | None, *, edge_index (2, E)) -> (N, out_features * num_heads).
    """

    def __init__(self, in_features: int, out_features: int, num_heads: int = 1, dropout: float = 0.6,
                 alpha: float = 0.2):
        super().__init__()
        self.in_features, self.out_features, self.num_heads = in_features, out_features, num_heads
        self.dropout, self.alpha = dropout, alpha
        self.W = nn.Parameter(torch.zeros(size=(in_features, out_features * num_heads)))
        nn.init.xavier_uniform_(self.W.data, gain=1.414)
        self.a = nn.Parameter(torch.zeros(size=(2 * out_features * num_heads, 1)))
        nn.init.xavier_uniform_(self.a.data, gain=1.414)
        self.leakyrelu = nn.LeakyReLU(self.alpha)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, X, adj_matrix=None, *, edge_index=None):
        n = _check_graph(X, adj_matrix, edge_index, None, "GATLayer")
        if X.shape[1] != self.in_features:
            raise ValueError(f"GATLayer: argument 'X' must have {self.in_features} features, got {tuple(X.shape)}")
        h = torch.mm(X, self.W)
        f = h.shape[1]
        s_dst = (h @ self.a[:f]).squeeze(-1)  # a_1 . h_i, i = the attending node
        s_src = (h @ self.a[f:]).squeeze(-1)  # a_2 . h_j
        if adj_matrix is not None:
            adj = adj_matrix.to_dense() if adj_matrix.is_sparse else adj_matrix
            e = self.leakyrelu(s_dst[:, None] + s_src[None, :])
            att = self.softmax(torch.where(adj > 0, e, torch.full_like(e, -9e15)))
            att = F.dropout(att, self.dropout, training=self.training)
            return att @ h
        src, dst, _ = _coalesce(edge_index, n, None, reduce_sum=False)
        e = self.leakyrelu(s_dst[dst] + s_src[src])
        emax = torch.full((n,), float("-inf"), dtype=e.dtype, device=e.device).scatter_reduce(
            0, dst, e, reduce="amax", include_self=True)
        p = torch.exp(e - emax[dst])
        denom = torch.zeros(n, dtype=e.dtype, device=e.device).index_add_(0, dst, p)
        att = F.dropout(p / denom[dst], self.dropout, training=self.training)
        out = _aggregate(h, src, dst, att, n)
        has_in = torch.zeros(n, dtype=torch.bool, device=h.device)
        has_in[dst] = True
        if not bool(has_in.all()):  # the dense code's all-masked row: softmax of equal scores = mean over nodes
            out = torch.where(has_in[:, None], out, h.mean(0, keepdim=True).expand_as(out))
        return out


class GAT(nn.Module):
    """Two-layer GAT of guide 001. forward(X, adj_matrix | None, *, edge_index) -> log-probabilities (N, C)."""

    def __init__(self, in_features: int, hidden_dim: int, num_classes: int, num_heads: int = 8,
                 dropout: float = 0.6):
        super().__init__()
        self.gat1 = GATLayer(in_features, hidden_dim, num_heads=num_heads, dropout=dropout)
        self.gat2 = GATLayer(hidden_dim * num_heads, num_classes, num_heads=1, dropout=dropout)
        self.dropout = dropout

    def forward(self, X, adj_matrix=None, *, edge_index=None):
        x = F.dropout(X, self.dropout, training=self.training)
        x = F.elu(self.gat1(x, adj_matrix, edge_index=edge_index))
        x = F.dropout(x, self.dropout, training=self.training)
        return F.log_softmax(self.gat2(x, adj_matrix, edge_index=edge_index), dim=-1)
