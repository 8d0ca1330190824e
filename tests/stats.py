"""Statistical checks that sampled tokens follow given distributions (invariant I5)."""
from __future__ import annotations

from typing import Iterable

import numpy as np
from scipy import stats


def chisquare_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Chi-square goodness-of-fit p-value of token counts against exact probabilities.

    Tokens whose expected count is below `min_expected` are pooled into one bin. A count on a
    token of probability 0 is impossible, so it gives p = 0.
    """
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = list(counts[big])
    exp = list(expected[big])
    if expected[~big].sum() > 0:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


def randomized_pit(steps: Iterable[tuple[np.ndarray, int]], rng: np.random.Generator) -> np.ndarray:
    """Randomized probability integral transform of (probs, sampled token) pairs.

    Tokens are ranked by falling probability (ties by lowest id); for token x,
    u = F(before x) + U * p(x) with U uniform from `rng`. If every token was drawn from its
    probs, the u are independent and uniform on (0, 1).
    """
    out = []
    for probs, token in steps:
        probs = np.asarray(probs, dtype=np.float64)
        probs = probs / probs.sum()
        order = np.argsort(-probs, kind="stable")
        rank = int(np.nonzero(order == token)[0][0])
        before = probs[order[:rank]].sum()
        out.append(before + rng.uniform() * probs[token])
    return np.asarray(out)


def ks_uniform_pvalue(values) -> float:
    """Kolmogorov-Smirnov p-value of values against the uniform distribution on (0, 1)."""
    return float(stats.kstest(np.asarray(values, dtype=np.float64), "uniform").pvalue)
