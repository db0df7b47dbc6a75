r"""The noise floor: how much weight one signal key keeps among ``N`` distractors.

The seeds' argument (common-mode rejection): softmax never gives a key zero weight, so ``N``
irrelevant keys each get ``O(1/N)`` and together ``O(1)``; the mass they take grows with the
context and dilutes the signal. A differential map ``A1 - lambda * A2`` subtracts a second map
that spreads the same background mass over the same keys, so the shared (common-mode) part
cancels and the signal, which only ``A1`` singles out, stays.

Closed form (:func:`noise_floor_closed_form`). One signal key whose logit exceeds every
distractor's by ``m`` (all distractors equal: pure common mode). A softmax map gives

    signal      s(m, N) = e^m / (e^m + N) = sigmoid(m - ln N)
    distractors D(m, N) = N   / (e^m + N) = sigmoid(ln N - m)        (s + D = 1)

A differential map with ``A1`` of margin ``m1`` and ``A2`` of margin ``m2`` (default 0: the
second map does not single out the signal) gives

    signal      s1 - lambda * s2
    distractors D1 - lambda * D2 = sigmoid(ln N - m1) - lambda * sigmoid(ln N - m2)

(rows sum to ``1 - lambda``). With ``a = e^m1``, ``b = e^m2`` the ratio of the two
signal-to-distractor ratios (:func:`closed_form_gain`, the report's "gain") is exactly

    G(N) = (diff s / |diff D|) / (softmax s / D)
         = (N (a - lambda b) + (1 - lambda) a b) / (a |(1 - lambda) N + b - lambda a|)

- For large N it tends to ``(a - lambda b) / ((1 - lambda) a)`` (:func:`asymptotic_gain`), about
  ``1 / (1 - lambda)``: 4.97x for m = 5, lambda = 0.8, m2 = 0 (not quite 5, since ``A2`` keeps
  ``lambda b`` of signal out of ``a``).
- It is larger at smaller N, and unbounded at ``N* = (lambda a - b) / (1 - lambda)``
  (:func:`cancellation_point`; 589 for m = 5, lambda = 0.8): there the distractor total
  ``D1 - lambda D2`` passes through zero (``lambda = D1 / D2``, exact cancellation). Below
  ``N*`` the distractor total is negative (``A2`` takes away more background than ``A1`` put
  there). So G(1024) = 11.70x, G(4096) = 5.81x, G(262144) = 4.98x at m = 5, lambda = 0.8: the
  "1 / (1 - lambda)" figure holds only for ``N >> N*``.

For ``N >> e^m1`` the distractor total tends to ``1 - lambda`` while the signal tends to
``(a - lambda b) / N``. The floor still grows with N for a fixed lambda; what moves is the
context length at which the distractors outweigh the signal, from ``N = e^m`` (softmax) to about
``N = e^m (1 + lambda) / (1 - lambda)`` (m2 = 0).

:func:`noise_floor_streamed` drops the "equal distractors" assumption: distractor logits are
random (``N(0, sigma^2)`` in ``A1``, correlated ``rho`` with those of ``A2``), one row of
``N`` weights at a time (no ``N x N`` matrix). With ``sigma = 0`` it equals the closed form;
with ``rho < 1`` part of the noise is not common mode and does not cancel.
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit, logsumexp

DEFAULT_NS = tuple(2**k for k in range(10, 19))  # 1K .. 256K
# The closed form eval.md shows: the signal key's logit margin, and lambda (the depth schedule's
# deep-layer value).
REPORT_MARGIN = 5.0
REPORT_LAMBDA = 0.8


def _check(num_distractors, lam):
    n = np.asarray(num_distractors, np.float64)
    if np.any(n < 1):
        raise ValueError(f"noise floor: num_distractors must be >= 1, got {num_distractors}")
    if not np.isfinite(lam):
        raise ValueError(f"noise floor: lambda must be finite, got {lam}")
    return n


def noise_floor_closed_form(
    num_distractors, margin: float, lam: float = 0.8, margin2: float = 0.0
) -> dict[str, np.ndarray]:
    """Signal weight and total distractor weight of a softmax map and of a differential map
    (see the module docstring), for each ``N`` in ``num_distractors`` (float64 arrays).

    Returns ``softmax_signal``, ``softmax_distractors``, ``diff_signal``, ``diff_distractors``
    (raw, rows of the differential map sum to ``1 - lam``) and the ratios
    ``softmax_snr = s / D`` and ``diff_snr = s / |D|``."""
    n = _check(num_distractors, lam)
    log_n = np.log(n)
    s1, d1 = expit(margin - log_n), expit(log_n - margin)
    s2, d2 = expit(margin2 - log_n), expit(log_n - margin2)
    ds, dd = s1 - lam * s2, d1 - lam * d2
    with np.errstate(divide="ignore"):  # inf at the cancellation point, where dd = 0
        diff_snr = ds / np.abs(dd)
    return {
        "num_distractors": n,
        "softmax_signal": s1,
        "softmax_distractors": d1,
        "diff_signal": ds,
        "diff_distractors": dd,
        "softmax_snr": s1 / d1,
        "diff_snr": diff_snr,
    }


def closed_form_gain(
    num_distractors, margin: float, lam: float = 0.8, margin2: float = 0.0
) -> np.ndarray:
    """``G(N)``, the differential map's signal-to-|distractor| ratio over softmax's, from the
    formula of the module docstring (equal to ``diff_snr / softmax_snr`` of
    :func:`noise_floor_closed_form`; inf at :func:`cancellation_point`)."""
    n = _check(num_distractors, lam)
    a, b = np.exp(margin), np.exp(margin2)
    with np.errstate(divide="ignore"):
        return (n * (a - lam * b) + (1.0 - lam) * a * b) / (
            a * np.abs((1.0 - lam) * n + b - lam * a)
        )


def asymptotic_gain(margin: float, lam: float = 0.8, margin2: float = 0.0) -> float:
    """The limit of :func:`closed_form_gain` for ``N -> inf``: ``(e^m - lam e^m2) / ((1 - lam)
    e^m)``, about ``1 / (1 - lam)``."""
    if not lam < 1.0:
        raise ValueError(f"asymptotic_gain: lambda must be < 1, got {lam}")
    a, b = np.exp(margin), np.exp(margin2)
    return float((a - lam * b) / ((1.0 - lam) * a))


def cancellation_point(margin: float, lam: float = 0.8, margin2: float = 0.0) -> float | None:
    """The number of distractors ``N* = (lam e^m - e^m2) / (1 - lam)`` at which the
    differential map's distractor total ``D1 - lam D2`` is exactly zero (None when no ``N >= 1``
    gives zero, e.g. ``lam >= 1`` or a small margin)."""
    if not lam < 1.0:
        return None
    n = (lam * np.exp(margin) - np.exp(margin2)) / (1.0 - lam)
    return float(n) if n >= 1.0 else None


def noise_floor_streamed(
    num_distractors: int,
    margin: float,
    lam: float = 0.8,
    margin2: float = 0.0,
    sigma: float = 0.0,
    rho: float = 1.0,
    seed: int = 0,
) -> dict[str, float]:
    """One query row with random distractor logits: ``z1 ~ N(0, sigma^2)`` for ``A1``, ``z2 =
    rho z1 + sqrt(1 - rho^2) N(0, sigma^2)`` for ``A2``; signal logits ``margin`` and
    ``margin2``. Returns the signal weight, the signed total and the absolute total
    (``sum |w|``) of the distractor weights, for softmax (``A1``) and the differential map."""
    n = int(_check(num_distractors, lam))
    if not -1.0 <= rho <= 1.0:
        raise ValueError(f"noise_floor_streamed: rho must be in [-1, 1], got {rho}")
    rng = np.random.default_rng(seed)
    z1 = sigma * rng.standard_normal(n)
    z2 = rho * z1 + np.sqrt(max(1.0 - rho * rho, 0.0)) * sigma * rng.standard_normal(n)
    lz1 = logsumexp(np.append(z1, margin))
    lz2 = logsumexp(np.append(z2, margin2))
    w1, w2 = np.exp(z1 - lz1), np.exp(z2 - lz2)
    s1, s2 = float(np.exp(margin - lz1)), float(np.exp(margin2 - lz2))
    wd = w1 - lam * w2
    return {
        "softmax_signal": s1,
        "softmax_distractors": float(w1.sum()),
        "diff_signal": s1 - lam * s2,
        "diff_distractors": float(wd.sum()),
        "diff_distractors_abs": float(np.abs(wd).sum()),
    }
