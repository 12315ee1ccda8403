"""Topology from Python (docs/SEMANTICS.md, "Combine" and "Topology"): the config fields, and the hand
case where the per-node rounding of the hierarchical combine order changes the bits.

R = 4 ranks, E = 4 (one expert per rank), one token on rank 0 routed to experts 0, 2, 1, unweighted;
holder y rows: rank 0: 1.0, ranks 1 and 2: 2^-8.
  flat (ranks_per_node = 0):  ((0 + 1) + 2^-8) + 2^-8 = 1 + 2^-7          -> 0x3F81
  nodes (ranks_per_node = 2): node 0 = bf16(1 + 2^-8) = 1.0 (tie to even); node 1 = 2^-8;
                              (0 + 1) + 2^-8 -> bf16 1.0 (tie to even)     -> 0x3F80
"""

import pytest

from conftest import ep, np, run_ranks

H = 8
ONE, EIGHTH = 0x3F80, 0x3B80


def hand(topology, ranks_per_node, scaleout="auto"):
    def body(r, g):
        b = ep.Buffer(g, num_experts=4, num_topk=3, hidden=H, max_tokens_per_rank=1, topology=topology,
                      ranks_per_node=ranks_per_node, scaleout=scaleout, timeout=10.0, backend="cpu")
        t = 1 if r == 0 else 0
        x = np.full((t, H), ONE, np.uint16)
        idx = np.array([[0, 2, 1]] * t, np.int32).reshape(t, 3)
        d = b.dispatch(x, idx, layout="masked")
        y = np.full(d.recv_x.shape, ONE if r == 0 else EIGHTH if r <= 2 else 0, np.uint16)
        out = b.combine(y, d.handle, weighted=False)
        return out.tolist(), b.settings.scaleout, b.settings.ranks_per_node

    return run_ranks(4, body)


def test_node_rounding_changes_the_bits():
    flat, nodes = [[0x3F81] * H], [[0x3F80] * H]
    assert hand("direct", 0)[0][0] == flat
    assert hand("direct", 2)[0][0] == nodes
    res = hand("hybrid", 2, "emulated")
    assert res[0][0] == nodes
    assert res[0][1:] == ("emulated", 2)


def test_bad_topology_options_are_named():
    def body(r, g):
        with pytest.raises(ep.InvalidArgumentError, match="unknown scaleout 'rdma'"):
            ep.Buffer(g, num_experts=4, num_topk=2, hidden=8, max_tokens_per_rank=1, topology="hybrid",
                      scaleout="rdma", backend="cpu")
        with pytest.raises(ep.InvalidArgumentError, match="scaleout=nccl only applies to topology=hybrid"):
            ep.Buffer(g, num_experts=4, num_topk=2, hidden=8, max_tokens_per_rank=1, scaleout="nccl", backend="cpu")
        with pytest.raises(ep.InvalidArgumentError, match="ranks_per_node=3 must divide"):
            ep.Buffer(g, num_experts=4, num_topk=2, hidden=8, max_tokens_per_rank=1, ranks_per_node=3, backend="cpu")
        with pytest.raises(ep.UnsupportedError, match="scaleout=gin needs the CUDA backend"):
            ep.Buffer(g, num_experts=4, num_topk=2, hidden=8, max_tokens_per_rank=1, topology="hybrid",
                      ranks_per_node=1, scaleout="gin", backend="cpu")
        return True

    assert run_ranks(2, body) == [True, True]
