"""Statistics of Pathfinder images, and two sets compared statistic by statistic with
two-sample tests (``scripts/pathfinder_compare.py`` is the command line; it holds the
generator, ``fastpos.tasks.pathfinder_generator``, against the original generator's images).

Per image (``statistics``): ``lit`` (pixels > 0), ``bright`` (pixels >= 128), ``mean``
intensity, ``dashes`` (8-connected components of the pixels >= 128: paddles, markers and their
unions), ``distractors`` (distractor snakes placed), ``label``; and a 16-bin intensity
histogram of the non-zero pixels. Tests (``compare``): two-sample Kolmogorov-Smirnov for the
counts and the mean (asymptotic p-value with Stephens' correction); permutation tests (images
shuffled between the sets, so pixels of one image stay together) for the positive rate and for
the histogram's L1 distance. numpy only.
"""

from __future__ import annotations

import numpy as np

SCALARS = ("lit", "bright", "mean", "dashes", "distractors", "label")
BINS = 16


def components(mask: np.ndarray) -> np.ndarray:
  """Number of 8-connected components of each bool image ``[n, h, w]`` -> int64 ``[n]``."""
  n, h, w = mask.shape
  big = n * h * w
  lab = np.where(mask.reshape(-1), np.arange(big), big).reshape(n, h, w)
  while True:
    pad = np.full((n, h + 2, w + 2), big, np.int64)
    pad[:, 1:-1, 1:-1] = lab
    low = lab
    for dy in (0, 1, 2):
      for dx in (0, 1, 2):
        low = np.minimum(low, pad[:, dy : dy + h, dx : dx + w])
    low = np.where(mask, low, big)
    flat = np.append(low.reshape(-1), big)
    low = np.where(mask, flat[low], big)  # pointer jumping
    if np.array_equal(low, lab):
      break
    lab = low
  roots = lab.reshape(n, -1) == np.arange(big).reshape(n, -1)
  return roots.sum(1)


def statistics(
    images: np.ndarray, labels: np.ndarray, num_distractors: np.ndarray | None = None
) -> dict[str, np.ndarray]:
  """Per-image statistics of uint8 images ``[n, r, r]``: each of ``SCALARS`` ``[n]`` and
  ``hist`` float64 ``[n, BINS]`` (shares of the non-zero pixels in 16 equal bins of 1..255)."""
  n = len(images)
  flat = images.reshape(n, -1)
  nz = np.maximum((flat > 0).sum(1), 1)
  bins = np.minimum((flat.astype(np.int64) - 1) * BINS // 255, BINS - 1)
  hist = np.zeros((n, BINS))
  for b in range(BINS):
    hist[:, b] = ((flat > 0) & (bins == b)).sum(1) / nz
  return {
      "lit": (flat > 0).sum(1),
      "bright": (flat >= 128).sum(1),
      "mean": flat.mean(1),
      "dashes": components(images >= 128),
      "distractors": (
          np.asarray(num_distractors) if num_distractors is not None else np.full(n, -1)
      ),
      "label": np.asarray(labels).astype(np.int64),
      "hist": hist,
  }


def ks_2samp(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
  """Two-sample Kolmogorov-Smirnov: (D, asymptotic p) (Stephens' small-sample correction)."""
  a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
  grid = np.concatenate([a, b])
  d = float(
      np.abs(
          np.searchsorted(a, grid, side="right") / len(a)
          - np.searchsorted(b, grid, side="right") / len(b)
      ).max()
  )
  ne = len(a) * len(b) / (len(a) + len(b))
  lam = (np.sqrt(ne) + 0.12 + 0.11 / np.sqrt(ne)) * d
  if lam < 1e-3:
    return d, 1.0
  k = np.arange(1, 101)
  p = 2 * np.sum((-1.0) ** (k - 1) * np.exp(-2 * k**2 * lam**2))
  return d, float(min(max(p, 0.0), 1.0))


def permutation_test(a, b, stat, num: int = 2000, seed: int = 0) -> tuple[float, float]:
  """(stat(a, b), share of ``num`` shuffles of the pooled rows with a statistic >= it)."""
  rng = np.random.default_rng(seed)
  pooled = np.concatenate([a, b])
  observed = stat(a, b)
  hits = 0
  for _ in range(num):
    p = rng.permutation(len(pooled))
    hits += stat(pooled[p[: len(a)]], pooled[p[len(a) :]]) >= observed - 1e-12
  return float(observed), (hits + 1) / (num + 1)


def compare(ref: dict, ours: dict, seed: int = 0) -> list[tuple[str, float, float, str, float]]:
  """Rows (statistic, mean of ref, mean of ours, test, p-value)."""
  rows = []
  for name in SCALARS:
    a, b = np.asarray(ref[name]), np.asarray(ours[name])
    if (a < 0).any() or (b < 0).any():
      continue  # not recorded in one of the sets
    if name == "label":
      d, p = permutation_test(a, b, lambda x, y: abs(x.mean() - y.mean()), seed=seed)
      rows.append(("positive rate", a.mean(), b.mean(), f"perm |diff| {d:.3f}", p))
    else:
      d, p = ks_2samp(a, b)
      rows.append((name, a.mean(), b.mean(), f"KS D {d:.3f}", p))
  ha, hb = np.asarray(ref["hist"]), np.asarray(ours["hist"])
  d, p = permutation_test(
      ha, hb, lambda x, y: float(np.abs(x.mean(0) - y.mean(0)).sum()), num=500, seed=seed
  )
  rows.append(("pixel histogram", float("nan"), float("nan"), f"perm L1 {d:.3f}", p))
  return rows


def load(path: str) -> dict[str, np.ndarray]:
  """Statistics of an .npz of images or of statistics."""
  with np.load(path, allow_pickle=False) as z:
    data = {k: z[k] for k in z.files}
  if "images" in data:
    return statistics(data["images"], data["labels"], data.get("num_distractors"))
  missing = [k for k in (*SCALARS, "hist") if k not in data]
  if missing:
    raise ValueError(f"{path}: neither images nor statistics (missing {missing}).")
  return data


def table(rows, n_ref: int, n_ours: int) -> str:
  out = [
      f"| statistic | reference (n={n_ref}) | ours (n={n_ours}) | test | p |",
      "|---|---|---|---|---|",
  ]
  for name, ma, mb, test, p in rows:
    means = ("-", "-") if np.isnan(ma) else (f"{ma:.3f}", f"{mb:.3f}")
    out.append(f"| {name} | {means[0]} | {means[1]} | {test} | {p:.3f} |")
  return "\n".join(out)
