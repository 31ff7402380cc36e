"""The statistics of the result tables: a mean with its Student-t interval over seeds, the
paired difference of two settings run on the same seeds, and the verdict on a claim.

Plain Python and ``math`` (no scipy): the t quantile inverts the t distribution's CDF, written
with the regularized incomplete beta function (Numerical Recipes' continued fraction, Lentz's
method), by bisection to 1e-12.

  mean_interval([0.36, 0.38, 0.40])         -> Interval(mean=0.38, lo=0.3303, hi=0.4297, n=3)
  d = paired_difference({0: 0.40, 1: 0.41, 2: 0.43}, {0: 0.37, 1: 0.39, 2: 0.40})
                                            -> Interval(mean=0.0267, lo=0.0123, hi=0.0410, n=3)
  verdict(d, higher_is_better=True)         -> "holds"
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, NamedTuple

HOLDS, DOES_NOT_HOLD, INCONCLUSIVE = "holds", "does not hold", "inconclusive"


class Interval(NamedTuple):
  """A mean over ``n`` values and its two-sided interval ``[lo, hi]`` (None for n < 2)."""

  mean: float
  lo: float | None
  hi: float | None
  n: int


def _betacf(a: float, b: float, x: float) -> float:
  """The continued fraction of the incomplete beta function (modified Lentz)."""
  tiny, eps = 1e-300, 1e-15
  qab, qap, qam = a + b, a + 1.0, a - 1.0
  c, d = 1.0, 1.0 - qab * x / qap
  d = 1.0 / (d if abs(d) > tiny else tiny)
  h = d
  for m in range(1, 10_000):
    m2 = 2 * m
    aa = m * (b - m) * x / ((qam + m2) * (a + m2))
    d = 1.0 + aa * d
    d = 1.0 / (d if abs(d) > tiny else tiny)
    c = 1.0 + aa / c
    c = c if abs(c) > tiny else tiny
    h *= d * c
    aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
    d = 1.0 + aa * d
    d = 1.0 / (d if abs(d) > tiny else tiny)
    c = 1.0 + aa / c
    c = c if abs(c) > tiny else tiny
    delta = d * c
    h *= delta
    if abs(delta - 1.0) < eps:
      return h
  raise ArithmeticError(f"incomplete beta: no convergence for a={a}, b={b}, x={x}.")


def betainc(a: float, b: float, x: float) -> float:
  """The regularized incomplete beta function I_x(a, b), for a, b > 0 and 0 <= x <= 1."""
  if not 0.0 <= x <= 1.0:
    raise ValueError(f"betainc: x={x} is outside [0, 1].")
  if x in (0.0, 1.0):
    return x
  log_front = (
      math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
  )
  if x < (a + 1.0) / (a + b + 2.0):
    return math.exp(log_front) * _betacf(a, b, x) / a
  return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
  """P(T <= t) for Student's t with ``df`` > 0 degrees of freedom."""
  if df <= 0:
    raise ValueError(f"t_cdf: df={df} must be > 0.")
  tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
  return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
  """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``t_quantile(0.975, 2)``
  = 4.3027), by bisection on ``t_cdf`` to 1e-12."""
  if not 0.0 < p < 1.0:
    raise ValueError(f"t_quantile: p={p} is outside (0, 1).")
  if p < 0.5:
    return -t_quantile(1.0 - p, df)
  lo, hi = 0.0, 1.0
  while t_cdf(hi, df) < p:
    hi *= 2.0
  while hi - lo > 1e-12 * max(1.0, hi):
    mid = 0.5 * (lo + hi)
    if t_cdf(mid, df) < p:
      lo = mid
    else:
      hi = mid
  return 0.5 * (lo + hi)


def mean_interval(values: Iterable[float], level: float = 0.95) -> Interval:
  """The mean of ``values`` and its ``level`` Student-t interval, mean ± t_{(1+level)/2, n-1}
  · s / sqrt(n) with s the sample standard deviation (ddof=1); lo = hi = None for one value.
  Raises ValueError for no values or a value that is not finite."""
  xs = [float(v) for v in values]
  if not xs:
    raise ValueError("mean_interval: no values.")
  if not all(math.isfinite(x) for x in xs):
    raise ValueError(f"mean_interval: a value is not finite: {xs}.")
  if not 0.0 < level < 1.0:
    raise ValueError(f"mean_interval: level={level} is outside (0, 1).")
  n = len(xs)
  mean = sum(xs) / n
  if n < 2:
    return Interval(mean, None, None, n)
  std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
  half = t_quantile(0.5 + level / 2.0, n - 1) * std / math.sqrt(n)
  return Interval(mean, mean - half, mean + half, n)


def paired_difference(
    claim: Mapping[object, float], baseline: Mapping[object, float], level: float = 0.95
) -> Interval:
  """``claim - baseline`` over the seeds both have (keys of the two mappings, seed -> value),
  its mean and ``level`` t-interval (the paired t-interval). Raises ValueError when the two
  share no seed."""
  common = [k for k in claim if k in baseline]
  if not common:
    raise ValueError(
        f"paired_difference: no seed in common (claim {sorted(map(str, claim))}, "
        f"baseline {sorted(map(str, baseline))})."
    )
  return mean_interval([claim[k] - baseline[k] for k in common], level)


def verdict(difference: Interval, *, higher_is_better: bool) -> str:
  """``holds`` when the interval of ``claim - baseline`` excludes 0 on the better side
  (above 0 when higher is better), ``does not hold`` when it excludes 0 on the other side,
  else (or with fewer than 2 pairs) ``inconclusive``."""
  if difference.lo is None or difference.hi is None:
    return INCONCLUSIVE
  sign = 1.0 if higher_is_better else -1.0
  lo, hi = sorted((sign * difference.lo, sign * difference.hi))
  if lo > 0:
    return HOLDS
  if hi < 0:
    return DOES_NOT_HOLD
  return INCONCLUSIVE
