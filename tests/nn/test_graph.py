"""GCN/GAT: dense drop-in vs guide 001, sparse edge_index == dense, and a 100k-node graph on CPU."""

import pytest
import torch
import torch.nn.functional as F

import fastarch.nn as fnn
from fastarch.testing import guides as G
from fastarch.testing.dropin import assert_dropin, assert_trains

N = 30
X = torch.randn(N, 8)


def _graph(n=N, e=90, self_loops=False):
    ei = torch.randint(0, n, (2, e))
    if self_loops:
        ei = torch.cat([ei, torch.arange(n).repeat(2, 1)], 1)
    return ei


def test_dense_dropin():
    adj = fnn.edge_index_to_dense(_graph(), N)
    assert_dropin(fnn.GCN(8, [16, 12], 4), G.GCN001(8, [16, 12], 4), X, adj)
    assert_dropin(fnn.GAT(8, 6, 4, num_heads=3), G.GAT001(8, 6, 4, num_heads=3), X, adj)
    assert_dropin(fnn.GATLayer(8, 6, 2), G.GATLayer001(8, 6, 2), X, (adj > 0).float())
    assert_dropin(fnn.GraphConvLayer(8, 5), G.GraphConvLayer001(8, 5), X, adj)


@pytest.mark.parametrize("self_loops", [False, True])
def test_sparse_equals_dense(self_loops):
    ei = _graph(self_loops=self_loops)  # duplicates and isolated nodes included
    adj = fnn.edge_index_to_dense(ei, N)
    for m in (fnn.GCN(8, [16], 4).eval(), fnn.GAT(8, 6, 4, num_heads=2).eval()):
        xd = X.clone().requires_grad_(True)
        xs = X.clone().requires_grad_(True)
        dense, sparse = m(xd, adj), m(xs, edge_index=ei)
        torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-4)
        gd = torch.autograd.grad(dense.square().sum(), [xd] + list(m.parameters()))
        gs = torch.autograd.grad(sparse.square().sum(), [xs] + list(m.parameters()))
        for a, b in zip(gs, gd):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_weighted_edges_and_torch_sparse_adjacency():
    ei = _graph()
    w = torch.rand(ei.shape[1])
    adj = fnn.edge_index_to_dense(ei, N, w)
    m = fnn.GCN(8, [16], 4).eval()
    torch.testing.assert_close(m(X, edge_index=ei, edge_weight=w), m(X, adj), atol=1e-5, rtol=1e-4)
    layer = fnn.GraphConvLayer(8, 4)
    torch.testing.assert_close(layer(X, adj.to_sparse()), layer(X, adj), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(layer(X, edge_index=ei, edge_weight=w), layer(X, adj), atol=1e-5, rtol=1e-4)


def test_large_sparse_graph_runs_on_cpu():
    n, e = 100_000, 400_000
    x = torch.randn(n, 8)
    ei = torch.randint(0, n, (2, e))
    gcn, gat = fnn.GCN(8, [16], 3).eval(), fnn.GAT(8, 4, 3, num_heads=2).eval()
    with torch.no_grad():
        assert gcn(x, edge_index=ei).shape == (n, 3)
        assert torch.isfinite(gat(x, edge_index=ei)).all()


def test_bad_inputs():
    m = fnn.GCN(8, [16], 4)
    with pytest.raises(ValueError, match="exactly one"):
        m(X)
    with pytest.raises(ValueError, match="outside"):
        m(X, edge_index=torch.tensor([[0, N], [1, 2]]))
    with pytest.raises(ValueError, match="adj_matrix"):
        m(X, torch.ones(N, N + 1))


def test_training_lowers_loss():
    ei = _graph(self_loops=True)
    y = torch.randint(0, 4, (N,))
    assert_trains(fnn.GCN(8, [16], 4, dropout=0.0), lambda m: F.cross_entropy(m(X, edge_index=ei), y), steps=10)
    assert_trains(fnn.GAT(8, 6, 4, num_heads=2, dropout=0.0), lambda m: F.nll_loss(m(X, edge_index=ei), y), steps=10)
