"""Plain numpy transcriptions of the aggregation rules: slow, loop-based, obviously right.

The fast torch rules are tested against these on random inputs.
"""

import math
from fractions import Fraction

import numpy as np


def dist2(a, b):
    return float(((a - b) ** 2).sum())


def mean(x):
    return x.mean(0)


def median(x):
    return np.median(x, axis=0)


def trmean(x, f):
    n = len(x)
    return np.sort(x, axis=0)[f : n - f].mean(0)


def krum_scores(x, f):
    n = len(x)
    scores = []
    for i in range(n):
        d = sorted(dist2(x[i], x[j]) for j in range(n) if j != i)
        scores.append(sum(d[: n - f - 2]))
    return np.array(scores)


def krum(x, f):
    return x[int(np.argmin(krum_scores(x, f)))]


def multikrum(x, f, m=None):
    m = len(x) - f if m is None else m
    return x[np.argsort(krum_scores(x, f), kind="stable")[:m]].mean(0)


def geomed(x, iters=30, nu=1e-6):
    z = np.median(x, axis=0)
    for _ in range(iters):
        w = np.array([1.0 / max(nu, np.sqrt(dist2(xi, z))) for xi in x])
        z = (w[:, None] * x).sum(0) / w.sum()
    return z


def cc(x, tau=1.0, iters=3, start=None):
    """Centered clipping's iterations from `start` (None: the coordinate-wise median)."""
    v = np.median(x, axis=0) if start is None else np.array(start, dtype=float)
    for _ in range(iters):
        total = np.zeros_like(v)
        for xi in x:
            diff = xi - v
            norm = np.sqrt((diff ** 2).sum())
            total += diff * min(1.0, tau / norm) if norm > 0 else diff
        v = v + total / len(x)
    return v


def cc_rounds(rounds, tau=10.0, iters=3):
    """Centered clipping as Karimireddy, He and Jaggi publish it, over rounds: each round starts
    from the previous round's aggregate, the first from zeros (the authors' code)."""
    out, v = [], np.zeros(rounds[0].shape[1])
    for x in rounds:
        v = cc(x, tau, iters, start=v)
        out.append(v)
    return out


def meamed(x, f):
    n, d = x.shape
    med = np.median(x, axis=0)
    out = np.empty(d)
    for c in range(d):
        order = np.lexsort((x[:, c], np.abs(x[:, c] - med[c])))  # by distance, then value
        out[c] = x[order[: n - f], c].mean()
    return out


def nearest_mean(x, i, k):
    order = sorted(range(len(x)), key=lambda j: (j != i, dist2(x[i], x[j])))
    return x[order[:k]].mean(0)


def monna(x, f, idx=0):
    return nearest_mean(x, idx, len(x) - f)


def nnm(x, f):
    return np.stack([nearest_mean(x, i, len(x) - f) for i in range(len(x))])


def bucketing(x, s, perm):
    shuffled = x[perm]
    return np.stack([shuffled[i : i + s].mean(0) for i in range(0, len(x), s)])


def clip_rows(x, threshold):
    out = x.copy()
    for i, xi in enumerate(x):
        norm = np.sqrt((xi ** 2).sum())
        if norm > threshold:
            out[i] = xi * threshold / norm
    return out


def clipping(x, c=None):
    norms = np.sqrt((x ** 2).sum(1))
    return clip_rows(x, np.sort(norms)[(len(x) - 1) // 2] if c is None else c)  # lower median


def arc(x, f):
    n = len(x)
    k = math.floor(Fraction(2 * f * (n - f), n))  # exact: 2 * (3/9) * 6 is 3.999... in floats
    if k == 0:
        return x.copy()
    norms = np.sort(np.sqrt((x ** 2).sum(1)))[::-1]
    return clip_rows(x, norms[k])
