"""Worst relative error of every fast op against its dense reference (float64 and float32).

Random inputs, lengths 1..1000 in float64 and N=4096 in float32 (against the float64
reference); error = max|fast - dense| / max|dense|. Kernelized RPE runs its FFT path at every
length (the op's dense switch is set to 0 here). Prints a Markdown table (the accuracy table
of benchmarks/README.md).

  python -m benchmarks ops_accuracy
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from fastpos.ops import attention, toeplitz, transformer_xl


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _mode_rows(lin, lengths, ident, f32) -> list[tuple[str, float, float]]:
  """The causal op by algorithm (``mode=``), plain and with PermuteFormer's decay; the fused
  kernel runs in Pallas interpret mode off a GPU."""
  return [
      (
          f"linear_attention causal=True mode={mode}" + (" decay" if decay else ""),
          max(lin(n, True, False, ident, mode=mode, decay=decay) for n in lengths),
          lin(4096, True, False, f32, mode=mode, decay=decay),
      )
      for mode in ("recurrent", "chunk", "fused")
      for decay in (False, True)
  ]


def main(argv: list[str] | None = None) -> int:
  argparse.ArgumentParser(
      prog="python -m benchmarks ops_accuracy", description=__doc__.split("\n\n")[0]
  ).parse_args(argv)
  jax.config.update("jax_enable_x64", True)  # the float64 references (this process only)
  rng = np.random.default_rng(0)
  f32 = lambda a: None if a is None else np.asarray(a, np.float32)
  rows = []

  def toe(n, causal, dt):
    w, x = rng.normal(size=(2, 2 * n - 1)), rng.normal(size=(1, 2, n, 8))
    t = toeplitz.dense_toeplitz(w)
    if causal:
      t = jnp.where(toeplitz.causal_mask(n), t, 0)
    return rel(
        toeplitz.toeplitz_matmul(dt(w), dt(x), causal=causal), jnp.einsum("hij,bhjc->bhic", t, x)
    )

  def toe2(grid, causal, dt):
    h, wd = grid
    w, x = rng.normal(size=(2, 2 * h - 1, 2 * wd - 1)), rng.normal(size=(1, 2, h * wd, 8))
    t = toeplitz.dense_toeplitz_2d(w, grid)
    if causal:
      t = jnp.where(toeplitz.causal_mask(h * wd), t, 0)
    return rel(
        toeplitz.toeplitz_matmul_2d(dt(w), dt(x), grid, causal=causal),
        jnp.einsum("hij,bhjc->bhic", t, x),
    )

  def rpb2(grid, dt):
    h, wd = grid
    wr, wc = rng.normal(size=(2, 2 * h - 1)), rng.normal(size=(2, 2 * wd - 1))
    x = rng.normal(size=(1, 2, h * wd, 8))
    t = toeplitz.dense_toeplitz_2d(wr[:, :, None] + wc[:, None, :], grid)
    return rel(
        toeplitz.fastrpb_2d_matmul(dt(wr), dt(wc), dt(x), grid), jnp.einsum("hij,bhjc->bhic", t, x)
    )

  def lin(n, causal, use_rpe, dt, grid=None, mode="auto", decay=False):
    pq, pk = (np.exp(0.5 * rng.normal(size=(1, n, 2, 4))) for _ in range(2))
    v = rng.normal(size=(1, n, 2, 4))
    rpe = None
    if use_rpe:
      shape = (2, 2 * n - 1) if grid is None else (2, 2 * grid[0] - 1, 2 * grid[1] - 1)
      rpe = np.exp(rng.normal(size=shape))
    log_r = np.log(np.array([0.9, 0.99])) if decay else None
    ref = attention.linear_attention_reference(
        pq, pk, v, causal=causal, rpe=rpe, grid=grid, decay=log_r
    )
    # The FFT path at every length: the op takes the dense [N, N] weights up to
    # _RPE_DENSE_UP_TO, which would hold the reference's own formula to itself.
    dense_up_to, attention._RPE_DENSE_UP_TO = attention._RPE_DENSE_UP_TO, 0
    try:
      fast = attention.linear_attention(
          dt(pq), dt(pk), dt(v), causal=causal, rpe=dt(rpe), grid=grid, decay=dt(log_r), mode=mode
      )
    finally:
      attention._RPE_DENSE_UP_TO = dense_up_to
    return rel(fast, ref)

  def soft(n, causal, dt):
    q, k, v = (rng.normal(size=(1, n, 2, 16)) for _ in range(3))
    ref = attention.softmax_attention_reference(q, k, v, causal=causal)
    return rel(attention.softmax_attention(dt(q), dt(k), dt(v), causal=causal), ref)

  def txl(l, m, dt):
    q, rk, vb = (
        rng.normal(size=(1, l, 2, 8)),
        rng.normal(size=(m + l, 2, 8)),
        rng.normal(size=(2, 8)),
    )
    ref = transformer_xl.relative_logits_reference(q, rk, pos_bias=vb)
    return rel(transformer_xl.relative_logits(dt(q), dt(rk), pos_bias=dt(vb)), ref)

  ident = lambda a: a
  lengths = (1, 2, 7, 64, 257, 1000)
  grids = ((1, 1), (4, 4), (3, 5), (12, 10), (31, 32))
  for causal in (False, True):
    rows.append(
        (
            f"toeplitz_matmul causal={causal}",
            max(toe(n, causal, ident) for n in lengths),
            toe(4096, causal, f32),
        )
    )
    rows.append(
        (
            f"toeplitz_matmul_2d causal={causal}",
            max(toe2(g, causal, ident) for g in grids),
            toe2((64, 64), causal, f32),
        )
    )
  rows.append(("fastrpb_2d_matmul", max(rpb2(g, ident) for g in grids), rpb2((64, 64), f32)))
  for causal in (False, True):
    for use_rpe in (False, True):
      rows.append(
          (
              f"linear_attention causal={causal} rpe={use_rpe}",
              max(lin(n, causal, use_rpe, ident) for n in lengths),
              lin(4096, causal, use_rpe, f32),
          )
      )
    rows.append(
        (
            f"linear_attention 2D rpe causal={causal}",
            max(lin(g[0] * g[1], causal, True, ident, g) for g in grids),
            lin(4096, causal, True, f32, (64, 64)),
        )
    )
    rows.append(
        (
            f"softmax_attention causal={causal}",
            max(soft(n, causal, ident) for n in lengths),
            soft(4096, causal, f32),
        )
    )
  rows += _mode_rows(lin, lengths, ident, f32)
  rows.append(
      (
          "relative_logits (TXL)",
          max(txl(l, m, ident) for l, m in ((1, 0), (7, 4), (33, 10))),
          txl(512, 512, f32),
      )
  )
  print("| function | float64, N <= 1000 | float32, N = 4096 |")
  print("|---|---|---|")
  for name, e64, e32 in rows:
    print(f"| {name} | {e64:.1e} | {e32:.1e} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
