"""A NumPy oracle of the dispatch/combine contract, written from the spec, independent of the JAX code."""
from __future__ import annotations

import numpy as np


def valid_mask(idx: np.ndarray, num_experts: int) -> np.ndarray:
    """[..., T, R] bool: in range and not a repeat of an earlier k of the same token."""
    ok = (idx >= 0) & (idx < num_experts)
    r = idx.shape[-1]
    for k in range(r):
        for k2 in range(k):
            ok[..., k] &= ~((idx[..., k] == idx[..., k2]) & ok[..., k2])
    return ok


def dispatch(xs, idxs, num_experts: int, scales=None):
    """xs[r] [T, H], idxs[r] [T, R] for each rank r -> per rank (rows [n, H], scale rows, counts [L], row_of).

    row_of[(src, t, k)] = (dst rank, row index), for the combine oracle.
    """
    n = len(xs)
    l = num_experts // n
    valid = [valid_mask(np.asarray(i), num_experts) for i in idxs]
    out = []
    row_of = {}
    for q in range(n):
        rows, srows, counts = [], [], np.zeros(l, np.int32)
        for e in range(l):
            g = q * l + e
            for s in range(n):
                for t in range(xs[s].shape[0]):
                    ks = np.nonzero((idxs[s][t] == g) & valid[s][t])[0]
                    for k in ks:  # at most one: repeats are masked
                        row_of[(s, t, int(k))] = (q, len(rows))
                        rows.append(xs[s][t])
                        if scales is not None:
                            srows.append(scales[s][t])
                        counts[e] += 1
        rows_a = np.array(rows, dtype=xs[0].dtype).reshape(len(rows), *xs[0].shape[1:])
        srows_a = None
        if scales is not None:
            srows_a = np.array(srows, dtype=scales[0].dtype).reshape(len(srows), *scales[0].shape[1:])
        out.append((rows_a, srows_a, counts))
    return out, row_of


def combine(ys, weights, idxs, row_of, num_experts: int) -> list[np.ndarray]:
    """ys[q] [rows, H] float (expert outputs per rank) -> per source rank [T, H] float32 weighted sums."""
    outs = []
    for s, (w, idx) in enumerate(zip(weights, idxs)):
        t_count, r = idx.shape
        valid = valid_mask(np.asarray(idx), num_experts)
        acc = np.zeros((t_count, ys[0].shape[1]), np.float32)
        for t in range(t_count):
            for k in range(r):
                if valid[t, k]:
                    q, row = row_of[(s, t, k)]
                    acc[t] += np.float32(w[t, k]) * ys[q][row].astype(np.float32)
        outs.append(acc)
    return outs
