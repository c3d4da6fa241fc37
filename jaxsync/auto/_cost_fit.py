"""Calibration fits of the cost model (numpy only, no JAX).

What it is for: from the timings ``python -m jaxsync tune`` takes
(``jaxsync.auto._tune``), fit each link's ``alpha, beta, gamma`` and cost per call
(:func:`fit_link`), the cost per byte of a local copy (:func:`fit_copy`), and
each strategy's overhead per leaf and per byte beyond what its collectives and
copies predict (:func:`fit_overhead`, from whole synchronisations of synthetic
trees). The link and copy fits minimise the squared *relative* error, the
overheads the absolute log-ratio of predicted to measured (see
:func:`fit_overhead`).

May import: the standard library, numpy and ``jaxsync.auto._cost`` (no JAX).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from ._cost import Link, coefficients, collective_seconds


def fit_link(samples: Sequence[tuple], algorithm: dict | None = None) -> tuple[Link, dict]:
    """Fit ``alpha, beta, gamma`` (and ``call``) of one link from timed collectives.

    Args:
      samples: ``(kind, nbytes, members, seconds)`` measurements of one call
        sending one message of ``nbytes``, or ``(kind, nbytes, members, seconds,
        messages)``: one call sending ``messages`` messages of ``nbytes`` each.
        ``call`` (per call) is fitted only when some sample sends several
        messages in one call (otherwise it cannot be told from ``alpha``: 0).
      algorithm: the algorithm per kind the measurements used (default: ring
        allreduce, ring reduce-scatter/all-gather, pairwise all-to-all).

    Returns:
      ``(link, report)``: non-negative parameters minimising the squared
      *relative* error, and ``{"median_rel_error", "max_rel_error", "samples",
      "dropped"}`` (non-positive marginal times, i.e. noise, are dropped).

    Example:
      >>> from jaxsync.auto._cost import Link, collective_seconds
      >>> true = Link(alpha=2e-5, beta=1e-9, gamma=5e-10)
      >>> s = [(k, n, 2, collective_seconds(k, n, 2, true, "ring"))
      ...      for k in ("allreduce", "allgather") for n in (1e3, 1e5, 1e7)]
      >>> got, rep = fit_link(s)
      >>> [round(x / y, 6) for x, y in zip((got.alpha, got.beta, got.gamma),
      ...                                  (true.alpha, true.beta, true.gamma))]
      [1.0, 1.0, 1.0]
    """
    algorithm = {
        "allreduce": "ring",
        "allgather": "ring",
        "reduce_scatter": "ring",
        "alltoall": "pairwise",
        "broadcast": "binomial",
        **(algorithm or {}),
    }
    used = [tuple(s) + (1,) * (5 - len(s)) for s in samples if s[3] > 0]  # noise: <= 0
    if not used:
        raise ValueError("fit_link: no positive timing to fit")
    with_call = any(m > 1 for *_, m in used)
    rows, y = [], []
    for kind, n, p, t, m in used:
        a, b, c = coefficients(kind, n, p, algorithm[kind])
        w = 1.0 / max(float(t), 1e-9)
        rows.append([m * a * w, m * b * w, m * c * w] + ([w] if with_call else []))
        y.append(float(t) * w)
    A = np.asarray(rows, np.float64)
    # Scale the columns to unit norm so that alpha (1e-5) and beta (1e-10) are
    # solved with the same conditioning.
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    x = _nnls3(A / scale, np.asarray(y))
    alpha, beta, gamma, *call = (x / scale).tolist()
    link = Link(alpha, beta, gamma, algorithm="ring", call=call[0] if call else 0.0)
    errs = [
        abs(link.call + m * collective_seconds(k, n, p, link, algorithm[k]) - t) / t
        for k, n, p, t, m in used
    ]
    return link, {
        "median_rel_error": float(np.median(errs)),
        "max_rel_error": float(np.max(errs)),
        "samples": len(used),
        "dropped": len(samples) - len(used),
    }


def _nnls3(A, y):
    """Non-negative least squares for a few columns: the best of the
    unconstrained fits on every subset of columns whose solution is >= 0."""
    k = A.shape[1]
    best, best_res = np.zeros(k), float(np.sum(y * y))
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            sub = A[:, cols]
            if np.linalg.matrix_rank(sub) < r:
                continue
            sol, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(sol < 0):
                continue
            res = float(np.sum((sub @ sol - y) ** 2))
            if res < best_res:
                best = np.zeros(k)
                best[list(cols)] = sol
                best_res = res
    return best


def fit_copy(samples: Sequence[tuple[float, float]]) -> float:
    """Seconds per byte of a local copy from ``(bytes, seconds)``, through the origin.

    Example:
      >>> fit_copy([(1e6, 1e-3), (2e6, 2e-3)])
      1e-09
    """
    used = [s for s in samples if s[1] > 0] or [(1.0, 0.0)]
    n = np.asarray([s[0] for s in used], np.float64)
    t = np.asarray([s[1] for s in used], np.float64)
    w = 1.0 / np.maximum(t, 1e-9)
    return float(max(0.0, np.sum(n * t * w * w) / max(np.sum(n * n * w * w), 1e-300)))


def fit_overhead(
    samples: Sequence[tuple[float, float, float, float]], signed_leaf: bool = False
) -> tuple[tuple[float, float], dict]:
    """A strategy's overhead ``(seconds per leaf, seconds per byte)``.

    Args:
      samples: ``(leaves, bytes, measured seconds, modelled seconds)`` of whole
        synchronisations of a few trees, where "modelled" is the prediction
        without the overhead. At least two trees that differ in their ratio of
        leaves to bytes.
      signed_leaf: let the cost per leaf be negative too (``naive``: its one
        native call per leaf is priced with the per-call terms fitted on
        isolated calls, which overcount a chain of calls).

    Returns:
      ``((per_leaf, per_byte), report)``: the least total *absolute log-ratio*
      ``|log(predicted / measured)|`` of ``modelled + per_leaf * leaves +
      per_byte * bytes`` (a few whole syncs, one of which may be off by a lot on
      a shared machine: squares would let it pull the fit, and the model is
      judged by how many predictions fall near the measurement, not by
      squares; the log-ratio weighs a sample measured at a third of the model
      like one measured at three times it, where the relative error to the
      measurement would weigh the low one three times more and let one sync
      timed too fast pull the fit). A candidate that predicts a time of zero
      or less for any sample is never taken. ``per_leaf >= 0`` unless
      ``signed_leaf`` (a negative cost per leaf, extrapolated to a tree of
      many more leaves, would predict a negative time), ``per_byte`` of either
      sign (it rescales the bandwidth terms). With fewer than three trees only
      one of the two terms is fitted. No overhead at all is a candidate too, so
      the fit never leaves the samples worse off than before. The report gives
      the relative errors of the model before and after.

    Example:
      >>> s = [(L, B, 1e-3 + 2e-6 * L + 1e-9 * B, 1e-3) for L, B in
      ...      [(8, 2e6), (256, 5e5), (8, 1.6e7)]]
      >>> (leaf, byte), rep = fit_overhead(s)
      >>> round(leaf * 1e6, 6), round(byte * 1e9, 6)
      (2.0, 1.0)
    """
    used = [s for s in samples if s[2] > 0]
    if not used:
        return (0.0, 0.0), {"samples": 0, "dropped": len(samples)}
    L = np.asarray([s[0] for s in used], np.float64)
    B = np.asarray([s[1] for s in used], np.float64)
    t = np.asarray([s[2] for s in used], np.float64)
    m = np.asarray([s[3] for s in used], np.float64)
    r = t - m  # what the overhead must explain
    # The optimum of a least-absolute-deviations fit lies where as many
    # samples as there are free terms are met exactly: try every such point.
    cands = [(0.0, 0.0)]
    for i in range(len(used)):
        if L[i] > 0:
            cands.append((r[i] / L[i], 0.0))
        if B[i] > 0:
            cands.append((0.0, r[i] / B[i]))
    if len(used) >= 3:  # two unknowns need a third tree to be checked at all
        for i, j in itertools.combinations(range(len(used)), 2):
            det = L[i] * B[j] - L[j] * B[i]
            if abs(det) > 1e-12 * max(abs(L[i] * B[j]), abs(L[j] * B[i]), 1e-300):
                cands.append(((r[i] * B[j] - r[j] * B[i]) / det, (L[i] * r[j] - L[j] * r[i]) / det))
    cands = [c for c in cands if signed_leaf or c[0] >= 0.0]

    def log_error(c):
        pred = m + c[0] * L + c[1] * B
        return float(np.sum(np.abs(np.log(pred / t)))) if np.all(pred > 0) else np.inf

    # least total error; among equals the first (no overhead, then one term)
    per_leaf, per_byte = min(cands, key=log_error)
    after = np.abs(m + per_leaf * L + per_byte * B - t) / t
    return (float(per_leaf), float(per_byte)), {
        "samples": len(used),
        "dropped": len(samples) - len(used),
        "median_rel_error_before": float(np.median(np.abs(m - t) / t)),
        "median_rel_error": float(np.median(after)),
        "max_rel_error": float(np.max(after)),
    }
