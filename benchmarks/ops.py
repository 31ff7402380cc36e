"""Mode ``ops`` of ``python -m benchmarks speed``: the fast ops of ``fastpos.ops`` against their
lower bounds, forward and forward+backward, over sequence lengths.

Shapes (the benchmark's setting): batch 1, 8 heads, head dim 64. Toeplitz products act on
``x [1, 8, N, 64]`` (512 channels) with one relative table shared by the heads (FastRPB's
default, ``per_head=False``); linear attention on ``phi_q, phi_k [1, N, 8, m]`` and
``v [1, N, 8, 64]``.

Each table holds, per length and pass, the fast op, its FFT floor (where it has one) and its
dense reference:
  * floor: a bare ``rfft`` + ``irfft`` round trip over the same padded FFT size and channel
    count, channel-major input (no transposes), padding and the final slice included: what
    any FFT convolution of this size must pay;
  * dense: the O(N^2) product. For the Toeplitz tables it is ``T @ x`` with ``T [N, N]``
    prebuilt (an input, not built inside the timed function); 1D and 2D share it (the same
    matmul). For linear attention it is ``linear_attention_reference``.
Forward+backward is ``grad`` of ``sum(f(inputs) * cotangent)`` with respect to every float
input (tables included).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from benchmarks import measure as bm
from fastpos.ops import attention, toeplitz

HEADS, DIM = 8, 64
RPE_FEATURES = 32  # Luo et al.'s m for kernelized RPE
LINEAR_FEATURES = 64  # ELU+1 features of head dim 64
PASSES = ("fwd", "fwd+bwd")


def grid_for(n: int) -> tuple[int, int]:
  """The most square (H, W) with H * W == n and H <= W."""
  h = int(math.isqrt(n))
  while n % h:
    h -= 1
  return h, n // h


def with_backward(fn: Callable, make_inputs: Callable, argnums: tuple[int, ...]):
  """``(g, make)``: g(*inputs, ct) = grad of sum(fn(*inputs) * ct) w.r.t. ``argnums``."""

  def g(*args):
    *primal, ct = args
    loss = lambda *p: jnp.sum(fn(*p).astype(jnp.float32) * ct)
    return jax.grad(loss, argnums)(*primal)

  def make():
    inputs = make_inputs()
    out = jax.eval_shape(fn, *inputs)
    return (*inputs, bm.pseudo_normal(99, out.shape))

  return g, make


@dataclasses.dataclass
class Impl:
  """One implementation: builds ``(fn, make_inputs, float argnums)`` for a length.

  ``key``: the row's measurement key (``None``: derived from the table and variant); rows
  with the same key are measured once per length (the floors and the dense matmul that
  several variants and tables share).
  """

  label: str
  build: Callable[[int, jnp.dtype], tuple[Callable, Callable, tuple[int, ...]]]
  key: str | None = None


@dataclasses.dataclass
class Variant:
  """A fast path with its FFT floor (None if it has no FFT) and its dense reference."""

  fast: Impl
  floor: Impl | None
  dense: Impl


@dataclasses.dataclass
class OpTable:
  name: str
  title: str
  variants: dict[str, Variant]
  floor_note: str
  dense_note: str


def _normal(i, shape, dtype, scale=1.0):
  return bm.pseudo_normal(i, shape, dtype, scale)


def _x(n, dtype):
  return _normal(1, (1, HEADS, n, DIM), dtype)


# ---------------------------------------------------------------------------------------------
# Toeplitz products
# ---------------------------------------------------------------------------------------------
def _toeplitz_1d(causal: bool):
  def build(n, dtype):
    fn = lambda w, x: toeplitz.toeplitz_matmul(w, x, causal=causal)
    make = lambda: (_normal(0, (2 * n - 1,), dtype, 1.0 / n), _x(n, dtype))
    return fn, make, (0, 1)

  return build


def _toeplitz_2d(causal: bool):
  def build(n, dtype):
    h, w = grid_for(n)
    fn = lambda t, x: toeplitz.toeplitz_matmul_2d(t, x, (h, w), causal=causal)
    make = lambda: (_normal(0, (2 * h - 1, 2 * w - 1), dtype, 1.0 / n), _x(n, dtype))
    return fn, make, (0, 1)

  return build


def _fastrpb_2d(n, dtype):
  h, w = grid_for(n)
  fn = lambda wr, wc, x: toeplitz.fastrpb_2d_matmul(wr, wc, x, (h, w))
  make = lambda: (
      _normal(0, (2 * h - 1,), dtype, 1.0 / n),
      _normal(2, (2 * w - 1,), dtype, 1.0 / n),
      _x(n, dtype),
  )
  return fn, make, (0, 1, 2)


def _dense_product(n, dtype):
  fn = lambda t, x: jnp.einsum("ij,bhjc->bhic", t, x)
  make = lambda: (toeplitz.dense_toeplitz(_normal(0, (2 * n - 1,), dtype, 1.0 / n)), _x(n, dtype))
  return fn, make, (0, 1)


def _round_trip_1d(channels: int):
  def build(n, dtype):
    length = toeplitz.fft_size(2 * n - 1)

    def fn(x):
      y = jnp.fft.irfft(jnp.fft.rfft(x.astype(jnp.float32), n=length, axis=-1), n=length, axis=-1)
      return y[..., :n]

    make = lambda: (_normal(1, (1, HEADS, channels, n), dtype),)
    return fn, make, (0,)

  return build


def _round_trip_2d(n, dtype):
  h, w = grid_for(n)
  s = (toeplitz.fft_size(2 * h - 1), toeplitz.fft_size(2 * w - 1))

  def fn(x):
    y = jnp.fft.irfft2(jnp.fft.rfft2(x.astype(jnp.float32), s=s, axes=(-2, -1)), s=s, axes=(-2, -1))
    return y[..., :h, :w]

  make = lambda: (_normal(1, (1, HEADS, DIM, h, w), dtype),)
  return fn, make, (0,)


def _round_trip_axial(n, dtype):
  """The two 1D round trips of ``fastrpb_2d_matmul``: over H (rows) and W (columns)."""
  h, w = grid_for(n)
  rows, cols = _round_trip_1d(DIM)(h, dtype)[0], _round_trip_1d(DIM)(w, dtype)[0]
  fn = lambda xr, xc: jnp.concatenate([rows(xr).reshape(-1), cols(xc).reshape(-1)])
  make = lambda: (_normal(1, (1, HEADS, DIM, h), dtype), _normal(2, (1, HEADS, DIM, w), dtype))
  return fn, make, (0, 1)


# ---------------------------------------------------------------------------------------------
# Linear attention
# ---------------------------------------------------------------------------------------------
def _linear_inputs(n, m, dtype, rpe: bool):
  def make():
    phi_q = jax.nn.elu(_normal(0, (1, n, HEADS, m), jnp.float32)) + 1
    phi_k = jax.nn.elu(_normal(1, (1, n, HEADS, m), jnp.float32)) + 1
    v = _normal(2, (1, n, HEADS, DIM), dtype)
    out = (phi_q.astype(dtype), phi_k.astype(dtype), v)
    if rpe:
      out += (jnp.exp(_normal(3, (HEADS, 2 * n - 1), jnp.float32, 0.1)),)
    return out

  return make


def _linear(causal: bool, rpe: bool, reference: bool = False):
  m = RPE_FEATURES if rpe else LINEAR_FEATURES

  def build(n, dtype):
    op = attention.linear_attention_reference if reference else attention.linear_attention
    if rpe:
      fn = lambda q, k, v, c: op(q, k, v, causal=causal, rpe=c)
      return fn, _linear_inputs(n, m, dtype, True), (0, 1, 2, 3)
    fn = lambda q, k, v: op(q, k, v, causal=causal)
    return fn, _linear_inputs(n, m, dtype, False), (0, 1, 2)

  return build


def tables() -> list[OpTable]:
  dense = Impl("dense T@x", _dense_product, key="dense_product")
  floor_1d = Impl("rfft+irfft", _round_trip_1d(DIM), key="toeplitz_matmul/floor")
  floor_rpe = Impl("rfft+irfft m*d+m ch.", _round_trip_1d(RPE_FEATURES * DIM + RPE_FEATURES))

  def linear(variant, label, causal, rpe):
    return Variant(
        Impl(label, _linear(causal, rpe)),
        floor_rpe if rpe else None,
        Impl(f"dense reference {variant}", _linear(causal, rpe, reference=True)),
    )

  return [
      OpTable(
          "toeplitz_matmul",
          "toeplitz_matmul (1D)",
          {
              "bidirectional": Variant(Impl("fft", _toeplitz_1d(False)), floor_1d, dense),
              "causal": Variant(Impl("fft causal", _toeplitz_1d(True)), floor_1d, dense),
          },
          "bare rfft+irfft of [1, 8, 64, N] at L = fft_size(2N-1)",
          "T [N, N] prebuilt, T @ x (1D and 2D share it)",
      ),
      OpTable(
          "toeplitz_matmul_2d",
          "toeplitz_matmul_2d (square grid H x W = N)",
          {
              "bidirectional": Variant(
                  Impl("fft2", _toeplitz_2d(False)), Impl("rfft2+irfft2", _round_trip_2d), dense
              )
          },
          "bare rfft2+irfft2 of [1, 8, 64, H, W] at fft_size(2H-1) x fft_size(2W-1)",
          "T [N, N] prebuilt, T @ x (the same matmul as 1D)",
      ),
      OpTable(
          "fastrpb_2d_matmul",
          "fastrpb_2d_matmul (axial 2D, square grid)",
          {
              "axial": Variant(
                  Impl("axial", _fastrpb_2d), Impl("2 x rfft+irfft", _round_trip_axial), dense
              )
          },
          "bare 1D round trips of [1, 8, 64, H] and [1, 8, 64, W] (its two Toeplitz "
          "products; the O(N) sums over rows and columns are not in the floor)",
          "T [N, N] prebuilt, T @ x (the same matmul as 1D)",
      ),
      OpTable(
          "linear_attention",
          "linear_attention (m = 64; with rpe m = 32, Luo et al.)",
          {
              "bidirectional": linear("bidirectional", "linear", False, False),
              "causal (chunked)": linear("causal", "linear causal", True, False),
              "rpe": linear("rpe", "linear rpe", False, True),
          },
          "rpe row only: bare rfft+irfft of [1, 8, m*d+m = 2080, N] at fft_size(2N-1) "
          "(Luo et al.'s FFT over m*d channels plus the denominator's m)",
          "linear_attention_reference (materialised [1, 8, N, N] scores) of the same " "variant",
      ),
  ]


# ---------------------------------------------------------------------------------------------
# The mode
# ---------------------------------------------------------------------------------------------
# The rows the targets are read from, by length: they run under Limits.target_run_s.
TARGET_ROWS = {
    1024: ("toeplitz_matmul/bidirectional/fwd", "toeplitz_matmul/floor/fwd"),
    4096: (
        "toeplitz_matmul/bidirectional/fwd",
        "toeplitz_matmul/floor/fwd",
        "dense_product/fwd",
        "linear_attention/bidirectional/fwd",
        "linear_attention/bidirectional/fwd+bwd",
        "linear_attention/causal (chunked)/fwd",
        "linear_attention/causal (chunked)/fwd+bwd",
    ),
    16384: ("toeplitz_matmul/bidirectional/fwd", "toeplitz_matmul/floor/fwd", "dense_product/fwd"),
}


def _case(key: str, impl: Impl, n: int, dtype, pass_: str, limits: bm.Limits) -> bm.Case:
  fn, make, argnums = impl.build(n, dtype)
  if pass_ == "fwd+bwd":
    fn, make = with_backward(fn, make, argnums)
  critical = key in TARGET_ROWS.get(n, ())
  return bm.Case(key, fn, make, max_run_s=limits.target_run_s if critical else None)


def _roles(table: OpTable, variant: str, pass_: str) -> dict[str, tuple[str, Impl]]:
  """role ("fast", "floor", "dense") -> (measurement key, implementation)."""
  v = table.variants[variant]
  out = {
      "fast": (f"{table.name}/{variant}/{pass_}", v.fast),
      "dense": (f"{v.dense.key or f'{table.name}/{variant}/dense'}/{pass_}", v.dense),
  }
  if v.floor is not None:
    out["floor"] = (f"{v.floor.key or f'{table.name}/floor'}/{pass_}", v.floor)
  return out


def run(args, log) -> tuple[list[bm.Table], list[bm.Target]]:
  """Measures every op at every length of ``args.ops_lengths`` (one group per length)."""
  dtype = jnp.dtype(args.dtype)
  specs = tables()
  history: dict = {}
  results: dict[str, dict[int, bm.Result]] = {}
  for n in args.ops_lengths:
    cases: dict[str, bm.Case] = {}
    for t in specs:
      for variant in t.variants:
        for p in PASSES:
          for key, impl in _roles(t, variant, p).values():
            if key not in cases:
              cases[key] = _case(key, impl, n, dtype, p, args.limits)
    got = bm.measure_group(
        list(cases.values()),
        history=history,
        limits=args.limits,
        min_time_s=args.min_time,
        max_runs=args.repeats,
    )
    for key, res in got.items():
      results.setdefault(key, {})[n] = res
    log(
        f"ops N={n}: "
        + ", ".join(f"{k}={bm.fmt_ms(r.time_s)}" for k, r in got.items() if k.endswith("/fwd"))
    )
  out = [_table(t, results, args.ops_lengths) for t in specs]
  return out, _targets(results, args.ops_lengths)


def _ratio(a: bm.Result | None, b: bm.Result | None) -> float | None:
  if a is None or b is None or a.time_s is None or b.time_s is None:
    return None
  return a.time_s / b.time_s


def _fmt_ratio(r: float | None) -> str:
  return "-" if r is None else f"{r:.2f}x"


def exponent_lengths(lengths) -> list[int]:
  """The lengths a memory exponent is fitted over: 1K-16K where present, else all."""
  inside = [n for n in lengths if 1024 <= n <= 16384]
  return inside if len(inside) >= 2 else list(lengths)


def _table(t: OpTable, results, lengths) -> bm.Table:
  notes = bm.Footnotes()
  rows, data = [], {}
  time_series: dict[str, list] = {}
  mem_series: dict[str, list] = {}
  exps = []
  fit_n = exponent_lengths(lengths)
  for variant in t.variants:
    for p in PASSES:
      roles = _roles(t, variant, p)
      data[f"{variant}/{p}"] = {
          role: {n: results[k][n].as_dict() for n in lengths} for role, (k, _) in roles.items()
      }
      for n in lengths:
        r = {role: results[k][n] for role, (k, _) in roles.items()}
        fast, floor, dense = r["fast"], r.get("floor"), r["dense"]
        rows.append(
            [
                variant,
                str(n),
                p,
                notes.time(fast),
                notes.time(floor),
                _fmt_ratio(_ratio(fast, floor)),
                notes.time(dense),
                _fmt_ratio(_ratio(dense, fast)),
                notes.memory(fast),
                notes.memory(floor),
                notes.memory(dense),
            ]
        )
      for k, impl in roles.values():
        label = f"{impl.label} {p}"
        if label in time_series:
          continue
        time_series[label] = [
            (n, results[k][n].time_s * 1e3) for n in lengths if results[k][n].time_s is not None
        ]
        mem_series[label] = [
            (n, results[k][n].memory_bytes / 2**20)
            for n in lengths
            if results[k][n].memory_bytes is not None
        ]
        mems = [results[k][n].memory_bytes for n in fit_n]
        e = bm.fit_exponent(fit_n, mems) if None not in mems else None
        if e is not None:
          exps.append(f"{label} {e:.2f}")
  note_lines = [
      f"Lower bound (floor): {t.floor_note}.",
      f"Dense: {t.dense_note}.",
      "fast/floor: time over the floor (1.00x = the FFT's cost alone); dense/fast: "
      "speed-up over the dense product. Memory: compiled temp + argument + output.",
      f"Memory exponent (fit of log memory on log N over N = "
      f"{', '.join(map(str, fit_n))}): " + "; ".join(exps) + ".",
  ]
  header = [
      "variant",
      "N",
      "pass",
      "fast ms",
      "floor ms",
      "fast/floor",
      "dense ms",
      "dense/fast",
      "fast mem",
      "floor mem",
      "dense mem",
  ]
  panels = [
      bm.Panel(t.title, "N", "median ms", time_series),
      bm.Panel("memory (compiled)", "N", "MiB", mem_series),
  ]
  return bm.Table(t.name, t.title, header, rows, note_lines + notes.notes(), data, panels)


def _targets(results, lengths) -> list[bm.Target]:
  out = []

  def get(key, n):
    return results.get(key, {}).get(n)

  for n in (1024, 4096, 16384):
    text = f"toeplitz_matmul within 1.2x of the bare FFT round trip at N={n} (fwd)"
    fast, floor = get("toeplitz_matmul/bidirectional/fwd", n), get("toeplitz_matmul/floor/fwd", n)
    r = _ratio(fast, floor)
    out.append(
        _target(
            text,
            r,
            r is not None and r <= 1.2,
            n,
            lengths,
            lambda r=r, fast=fast, floor=floor: f"{r:.2f}x (fft {bm.fmt_ms(fast.time_s)} ms, floor "
            f"{bm.fmt_ms(floor.time_s)} ms)",
        )
    )
  for n, need in ((4096, 4.0), (16384, 10.0)):
    text = f"toeplitz_matmul >= {need:g}x faster than the prebuilt dense T @ x at N={n} (fwd)"
    fast, dense = get("toeplitz_matmul/bidirectional/fwd", n), get("dense_product/fwd", n)
    r = _ratio(dense, fast)
    out.append(
        _target(
            text,
            r,
            r is not None and r >= need,
            n,
            lengths,
            lambda r=r, dense=dense, fast=fast: f"{r:.2f}x (dense {bm.fmt_ms(dense.time_s)} ms, "
            f"fft {bm.fmt_ms(fast.time_s)} ms)",
        )
    )
  for p in ("fwd+bwd", "fwd"):
    text = f"causal linear attention (chunked) <= 2x the bidirectional one at N=4096 ({p})"
    c = get(f"linear_attention/causal (chunked)/{p}", 4096)
    b = get(f"linear_attention/bidirectional/{p}", 4096)
    r = _ratio(c, b)
    out.append(
        _target(
            text,
            r,
            r is not None and r <= 2.0,
            4096,
            lengths,
            lambda r=r, c=c, b=b: f"{r:.2f}x (causal {bm.fmt_ms(c.time_s)} ms, bidirectional "
            f"{bm.fmt_ms(b.time_s)} ms)",
        )
    )
  fit_n = exponent_lengths(lengths)
  worst = None
  for key, by_n in results.items():
    if "dense" in key or "floor" in key or not key.endswith("fwd+bwd"):
      continue
    mems = [by_n[n].memory_bytes for n in fit_n]
    e = bm.fit_exponent(fit_n, mems) if None not in mems else None
    if e is not None and (worst is None or e > worst[0]):
      worst = (e, key)
  text = "memory of every fast op grows linearly: fitted exponent over 1K-16K <= 1.1 (fwd+bwd)"
  if worst is None or not (fit_n[0] <= 1024 and fit_n[-1] >= 16384):
    out.append(bm.Target(text, f"not measured (lengths {lengths} do not span 1K-16K)", None))
  else:
    out.append(bm.Target(text, f"worst {worst[0]:.2f} ({worst[1]})", worst[0] <= 1.1))
  return out


def _target(text, value, ok, n, lengths, describe) -> bm.Target:
  if n not in lengths:
    return bm.Target(text, f"not measured (N={n} not in the lengths {list(lengths)})", None)
  if value is None:
    return bm.Target(text, "not measured (a row was skipped; see the table)", None)
  return bm.Target(text, describe(), ok)
