"""Demo: FastRPB attention (ELU+1 linear attention + W V by FFT) on random data.

Prints, for a few sequence lengths, the forward time of
  * dense softmax attention (XLA, O(N^2)),
  * ELU+1 linear attention + FastRPB (O(N log N)),
  * toeplitz_matmul (FFT) against the dense matmul with a prebuilt Toeplitz matrix,
all measured side by side in one process (medians after a warm-up), plus ratios.

  python scripts/demo_fastrpb.py [--lengths 1024,4096] [--heads 8] [--dim 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from fastpos.ops import attention, features, toeplitz


def _median_time(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile + warm-up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


@jax.jit
def softmax_layer(q, k, v):
  return attention.softmax_attention(q, k, v)


@jax.jit
def fastrpb_layer(q, k, v, w):
  """Y = LinearAttention(Q, K, V) + W V (FastRPB Eq. 10), one table per head."""
  y = attention.linear_attention(features.elu1(q), features.elu1(k), v)
  wv = toeplitz.toeplitz_matmul(w, jnp.transpose(v, (0, 2, 1, 3)))  # [b, h, n, d]
  return y + jnp.transpose(wv, (0, 2, 1, 3))


@jax.jit
def fft_product(w, x):
  return toeplitz.toeplitz_matmul(w, x)


@jax.jit
def dense_product(t, x):
  return t @ x


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="1024,4096", help="comma-separated N")
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  lengths = [int(n) for n in args.lengths.split(",")]
  rng = np.random.default_rng(0)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; batch 1, heads {args.heads}, "
        f"head dim {args.dim}, float32, forward, median of {args.repeats}")
  print(f"{'N':>7} | {'softmax ms':>10} | {'linear+FastRPB ms':>17} | {'speed-up':>8} || "
        f"{'Toeplitz FFT ms':>15} | {'dense T@x ms':>12} | {'speed-up':>8}")
  for n in lengths:
    q, k, v = (jnp.asarray(rng.normal(size=(1, n, args.heads, args.dim)), jnp.float32)
               for _ in range(3))
    w = jnp.asarray(rng.normal(size=(args.heads, 2 * n - 1)) / n, jnp.float32)
    t_soft = _median_time(softmax_layer, q, k, v, repeats=args.repeats)
    t_rpb = _median_time(fastrpb_layer, q, k, v, w, repeats=args.repeats)
    x = jnp.asarray(rng.normal(size=(n, args.dim)), jnp.float32)
    w1 = w[0]
    t_fft = _median_time(fft_product, w1, x, repeats=args.repeats)
    t_dense = _median_time(dense_product, toeplitz.dense_toeplitz(w1), x, repeats=args.repeats)
    print(f"{n:>7} | {t_soft * 1e3:>10.2f} | {t_rpb * 1e3:>17.2f} | {t_soft / t_rpb:>7.2f}x || "
          f"{t_fft * 1e3:>15.3f} | {t_dense * 1e3:>12.3f} | {t_dense / t_fft:>7.2f}x")


if __name__ == "__main__":
  main()
