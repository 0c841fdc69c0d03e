"""FLOP formulas: exact visible-pair counts against brute-force counting."""

import itertools

import pytest
import torch

from fastarch.bench.flops import (
    attention_flops,
    attention_pairs,
    linear_attention_flops,
    matmul_flops,
    mode_factor,
    selective_scan_flops,
)


def brute_pairs(lq: int, lk: int, causal: bool, window: tuple[int, int]) -> int:
    left, right = window
    if causal:
        right = 0
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return int(ok.sum())


SIZES = [0, 1, 2, 3, 5, 8, 13]
WINDOWS = [(-1, -1), (0, 0), (1, 0), (0, 1), (2, 3), (5, -1), (-1, 2), (20, 20), (3, 7)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_pairs_match_brute_force(causal, window):
    for lq, lk in itertools.product(SIZES, SIZES):
        assert attention_pairs(lq, lk, causal=causal, window=window) == brute_pairs(lq, lk, causal, window), (
            lq, lk, causal, window)


def test_pairs_known_values():
    assert attention_pairs(1024, 1024) == 1024 * 1024
    assert attention_pairs(1024, 1024, causal=True) == 1024 * 1025 // 2
    # window (w, w) on L: full band minus the clipped corners.
    L, w = 1000, 10
    assert attention_pairs(L, L, window=(w, w)) == L * (2 * w + 1) - w * (w + 1)
    # decoding one query against a cache: bottom-right alignment sees every key.
    assert attention_pairs(1, 4096, causal=True) == 4096
    assert attention_pairs(1, 4096, window=(255, 0)) == 256


def test_pairs_large_lengths_are_cheap_and_exact():
    L = 1 << 20
    assert attention_pairs(L, L, causal=True) == L * (L + 1) // 2
    w = 4096
    assert attention_pairs(L, L, window=(w, 0)) == L * (w + 1) - w * (w + 1) // 2


def test_attention_flops_conventions():
    b, h, L, d = 2, 3, 64, 32
    assert attention_flops(b, h, L, L, d) == 4 * b * h * L * L * d
    fwd = attention_flops(b, h, L, L, d, causal=True)
    assert fwd == 4 * b * h * (L * (L + 1) // 2) * d
    assert attention_flops(b, h, L, L, d, causal=True, mode="bwd") == 2.5 * fwd
    assert attention_flops(b, h, L, L, d, causal=True, mode="fwd_bwd") == 3.5 * fwd
    assert attention_flops(1, 1, 4, 4, 8, head_dim_v=16) == 2 * 16 * (8 + 16)
    with pytest.raises(ValueError, match="mode"):
        mode_factor("sideways")
    with pytest.raises(ValueError, match="lengths"):
        attention_pairs(-1, 3)


def test_other_formulas():
    assert matmul_flops(2, 3, 4) == 48
    assert linear_attention_flops(1, 1, 10, 4, 4) == 10 * (4 * 16 + 8)
    assert selective_scan_flops(2, 4, 8, 16, mode="fwd_bwd") == 8 * 2 * 4 * 8 * 16 * 3.5
