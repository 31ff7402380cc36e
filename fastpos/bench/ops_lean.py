"""Linear attention against the machine, and kernelized RPE against its peers.

``python -m fastpos.bench.ops_lean --out benchmarks`` measures, side by side in one process
(float32, CPU or whatever device JAX sees):

* the device's float32 matmul peak (one large ``jnp.dot``) and linear attention's fwd+bwd
  GFLOP/s against it, bidirectional and causal (chunked), for the op as it is and for the
  previous implementation kept here for comparison (``_previous_linear``: einsums in the
  ``[b, n, h, .]`` layout, and the causal path as a serial scan of chunks);
* causal linear attention against a Performer-style per-token scan (``_performer_causal``:
  the prefix state ``sum_j phi(k_j) v_j^T`` updated token by token under ``lax.scan``, with
  the Performer's reverse scan for the gradient);
* kernelized RPE (``linear_attention(rpe=...)``): backward temporary memory against the plain
  Toeplitz product of the same channel count (``memory_analysis`` of the compiled ``grad``),
  and fwd+bwd time against dense softmax attention with a bias.

Flops of linear attention (what GFLOP/s counts): per batch and head, the forward contraction
``phi_k^T [v, 1]`` and ``phi_q [kv, ks]`` is 4 N m (d + 1) and the backward twice that:
12 N m (d + 1) for fwd+bwd. The causal path is counted with the same number (the work of the
bidirectional algorithm; its in-chunk scores are extra work, not extra credit).

Writes ``<out>/ops_lean.md`` and ``.json`` with the goals and PASS / FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp

from fastpos.bench import measure as bm
from fastpos.ops import attention, toeplitz

BATCH, HEADS, DIM, FEATURES = 1, 8, 64, 64
RPE_FEATURES = 32  # Luo et al.'s m for kernelized RPE
PEAK_SIZE = 2048


# ---------------------------------------------------------------------------------------------
# Implementations kept for comparison only
# ---------------------------------------------------------------------------------------------
def _previous_linear(phi_q, phi_k, v, *, causal: bool, chunk: int = 64):
  """The op before the head-major rewrite: einsums in the ``[b, n, h, .]`` layout
  (bidirectional) and a serial ``lax.scan`` over chunks, each chunk transposed to head-major
  inside the rematerialised body (causal). No mask, rpe or decay (not timed here)."""
  if not causal:
    kv = jnp.einsum("bjhm,bjhd->bhmd", phi_k, v)
    num = jnp.einsum("bihm,bhmd->bihd", phi_q, kv)
    den = jnp.einsum("bihm,bhm->bih", phi_q, jnp.sum(phi_k, axis=1))
    return num / den[..., None]
  b, n, h, m = phi_k.shape
  d = v.shape[-1]
  g = -(-n // chunk)

  def split(a):
    a = jnp.pad(a, ((0, 0), (0, g * chunk - n), (0, 0), (0, 0)))
    return jnp.moveaxis(a.reshape(b, g, chunk, h, a.shape[-1]), 1, 0)

  mask = toeplitz.causal_mask(chunk)

  def body(carry, xs):
    kv, ks = carry
    q_c, k_c, v_c = (jnp.transpose(a, (0, 2, 1, 3)) for a in xs)
    scores = jnp.where(mask, jnp.einsum("bhim,bhjm->bhij", q_c, k_c), 0.0)
    num = jnp.einsum("bhim,bhmd->bhid", q_c, kv) + jnp.einsum("bhij,bhjd->bhid", scores, v_c)
    den = jnp.einsum("bhim,bhm->bhi", q_c, ks) + jnp.sum(scores, axis=-1)
    kv = kv + jnp.einsum("bhjm,bhjd->bhmd", k_c, v_c)
    ks = ks + jnp.sum(k_c, axis=2)
    return (kv, ks), (jnp.transpose(num, (0, 2, 1, 3)), jnp.transpose(den, (0, 2, 1)))

  init = (jnp.zeros((b, h, m, d), v.dtype), jnp.zeros((b, h, m), v.dtype))
  _, (num, den) = jax.lax.scan(jax.checkpoint(body), init, (split(phi_q), split(phi_k), split(v)))
  num = jnp.moveaxis(num, 0, 1).reshape(b, g * chunk, h, d)[:, :n]
  den = jnp.moveaxis(den, 0, 1).reshape(b, g * chunk, h)[:, :n]
  return num / den[..., None]


@jax.custom_vjp
def _prefix_numerator(q, k, v):
  """Performer's causal numerator: ``out_i = q_i . sum_{j<=i} k_j v_j^T`` by a per-token
  scan; q, k ``[n, b, h, m]``, v ``[n, b, h, d]`` (token-major, as the Performer code)."""
  return _prefix_numerator_fwd(q, k, v)[0]


def _prefix_numerator_fwd(q, k, v):
  def body(p, x):
    p = p + jnp.einsum("bhm,bhd->bhmd", x[1], x[2])
    return p, jnp.einsum("bhm,bhmd->bhd", x[0], p)

  p0 = jnp.zeros(k.shape[1:] + v.shape[-1:], v.dtype)
  p, out = jax.lax.scan(body, p0, (q, k, v))
  return out, (q, k, v, p)


def _prefix_numerator_bwd(res, ct):
  q, k, v, p = res

  def body(carry, x):  # the Performer way: undo the prefix state by subtraction
    p, gp = carry
    q_t, k_t, v_t, g_t = x
    gp = gp + jnp.einsum("bhm,bhd->bhmd", q_t, g_t)
    gq = jnp.einsum("bhd,bhmd->bhm", g_t, p)
    gk = jnp.einsum("bhmd,bhd->bhm", gp, v_t)
    gv = jnp.einsum("bhmd,bhm->bhd", gp, k_t)
    p = p - jnp.einsum("bhm,bhd->bhmd", k_t, v_t)
    return (p, gp), (gq, gk, gv)

  _, grads = jax.lax.scan(body, (p, jnp.zeros_like(p)), (q, k, v, ct), reverse=True)
  return grads


_prefix_numerator.defvjp(_prefix_numerator_fwd, _prefix_numerator_bwd)


def _performer_causal(phi_q, phi_k, v):
  """Performer-style causal linear attention: the numerator and (with ``v = 1``) the
  denominator by per-token scans. ``[b, n, h, .]`` in and out."""
  q, k, vals = (jnp.moveaxis(a, 1, 0) for a in (phi_q, phi_k, v))
  num = _prefix_numerator(q, k, vals)
  den = _prefix_numerator(q, k, jnp.ones(vals.shape[:-1] + (1,), vals.dtype))
  return jnp.moveaxis(num / den, 0, 1)


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------
def _features(seed, n, m):
  return jax.nn.elu(bm.pseudo_normal(seed, (BATCH, n, HEADS, m))) + 1.0


def _fwd_bwd(fn, argnums):
  """grad of sum(fn(*inputs) * ct) w.r.t. ``argnums``; the cotangent is the last input."""

  def g(*args):
    *primal, ct = args
    return jax.grad(lambda *p: jnp.sum(fn(*p) * ct), argnums)(*primal)

  return g


def _linear_case(key, fn, n):
  def make():
    v = bm.pseudo_normal(2, (BATCH, n, HEADS, DIM))
    return (
        _features(0, n, FEATURES),
        _features(1, n, FEATURES),
        v,
        bm.pseudo_normal(3, (BATCH, n, HEADS, DIM)),
    )

  return bm.Case(key, _fwd_bwd(fn, (0, 1, 2)), make)


def linear_flops(n: int) -> float:
  """fwd+bwd flops of linear attention's contraction (module docstring)."""
  return 12.0 * BATCH * HEADS * n * FEATURES * (DIM + 1)


def _peak_case():
  make = lambda: (
      bm.pseudo_normal(0, (PEAK_SIZE, PEAK_SIZE)),
      bm.pseudo_normal(1, (PEAK_SIZE, PEAK_SIZE)),
  )
  return bm.Case("matmul peak", jnp.dot, make)


LINEAR_ROWS = {
    "bidirectional": lambda q, k, v: attention.linear_attention(q, k, v),
    "bidirectional (previous)": lambda q, k, v: _previous_linear(q, k, v, causal=False),
    "causal": lambda q, k, v: attention.linear_attention(q, k, v, causal=True),
    "causal (previous)": lambda q, k, v: _previous_linear(q, k, v, causal=True),
    "causal Performer scan": _performer_causal,
}


def measure_linear(lengths, log, rounds: int) -> dict:
  """GFLOP/s of every ``LINEAR_ROWS`` row against the matmul peak, per length (each length
  one interleaved group with its own peak measurement)."""
  out = {}
  for n in lengths:
    cases = [_peak_case()] + [_linear_case(k, f, n) for k, f in LINEAR_ROWS.items()]
    got = bm.measure_group(cases, min_time_s=0.0, min_runs=rounds, max_runs=rounds)
    peak = 2.0 * PEAK_SIZE**3 / got["matmul peak"].time_s / 1e9
    row = {"peak_gflops": peak, "rows": {}}
    for key in LINEAR_ROWS:
      t = got[key].time_s
      gf = linear_flops(n) / t / 1e9
      row["rows"][key] = {
          "ms": 1e3 * t,
          "gflops": gf,
          "fraction_of_peak": gf / peak,
          "temp_mib": got[key].temp_bytes / 2**20,
      }
    out[n] = row
    log(
        f"N={n}: peak {peak:.1f} GFLOP/s; "
        + ", ".join(
            f"{k} {r['ms']:.1f} ms ({100 * r['fraction_of_peak']:.0f}%)"
            for k, r in row["rows"].items()
        )
    )
  return out


# ---------------------------------------------------------------------------------------------
# Kernelized RPE
# ---------------------------------------------------------------------------------------------
def _rpe_inputs(n):
  def make():
    return (
        _features(0, n, RPE_FEATURES),
        _features(1, n, RPE_FEATURES),
        bm.pseudo_normal(2, (BATCH, n, HEADS, DIM)),
        jnp.exp(bm.pseudo_normal(4, (HEADS, 2 * n - 1), scale=0.1)),
        bm.pseudo_normal(3, (BATCH, n, HEADS, DIM)),
    )

  return make


def _krpe(path: str, causal: bool = False):
  """linear_attention(rpe=...) on the path it picks by shape ("auto"), or forced to the FFT
  path ("fft", by lifting the dense limit while tracing) or the dense one ("dense")."""

  def fn(q, k, v, c):
    saved = attention._RPE_DENSE_UP_TO
    attention._RPE_DENSE_UP_TO = {"auto": saved, "fft": 0, "dense": 1 << 30}[path]
    try:
      return attention.linear_attention(q, k, v, rpe=c, causal=causal)
    finally:
      attention._RPE_DENSE_UP_TO = saved

  return fn


def _softmax_bias(q, k, v, c):
  """Dense softmax attention with the T5-style bias log c (the same table, materialised)."""
  bias = toeplitz.dense_toeplitz(jnp.log(c))
  return attention.softmax_attention(q, k, v, bias=bias)


def _softmax_inputs(n):
  def make():
    return tuple(bm.pseudo_normal(i, (BATCH, n, HEADS, DIM)) for i in range(3)) + (
        jnp.exp(bm.pseudo_normal(4, (HEADS, 2 * n - 1), scale=0.1)),
        bm.pseudo_normal(3, (BATCH, n, HEADS, DIM)),
    )

  return make


def _temp_mib(fn, make) -> float:
  specs = jax.eval_shape(make)
  exe = jax.jit(fn).lower(*specs).compile()
  return exe.memory_analysis().temp_size_in_bytes / 2**20


def measure_rpe_memory(lengths, log) -> dict:
  """Backward temp memory (MiB) of kernelized RPE (FFT path) and of the Toeplitz product over
  ``[b, h, N, d]`` (the channels of v), bidirectional and causal; compiled, not run."""
  out = {}
  for n in lengths:
    row = {}
    for causal in (False, True):
      krpe = _temp_mib(_fwd_bwd(_krpe("fft", causal), (0, 1, 2, 3)), _rpe_inputs(n))
      tp = _temp_mib(
          _fwd_bwd(lambda w, x, c=causal: toeplitz.toeplitz_matmul(w, x, causal=c), (0, 1)),
          lambda n=n: (
              bm.pseudo_normal(0, (2 * n - 1,)),
              bm.pseudo_normal(1, (BATCH, HEADS, n, DIM)),
              bm.pseudo_normal(2, (BATCH, HEADS, n, DIM)),
          ),
      )
      row["causal" if causal else "bidirectional"] = {
          "krpe_mib": krpe,
          "toeplitz_mib": tp,
          "ratio": krpe / tp,
      }
    out[n] = row
    log(
        f"N={n}: kRPE/toeplitz temp "
        + ", ".join(
            f"{k} {r['krpe_mib']:.1f}/{r['toeplitz_mib']:.1f} MiB = {r['ratio']:.2f}x"
            for k, r in row.items()
        )
    )
  return out


def measure_rpe_time(lengths, log, rounds: int, extra=None) -> dict:
  """fwd+bwd ms of kernelized RPE (as picked, FFT path, dense path) and of dense softmax with
  the bias, one interleaved group per length; ``extra(n)`` (optional) gives further cases
  timed in the same group."""
  out = {}
  for n in lengths:
    cases = [
        bm.Case(f"kRPE {p}", _fwd_bwd(_krpe(p), (0, 1, 2, 3)), _rpe_inputs(n))
        for p in ("auto", "fft", "dense")
    ]
    cases.append(
        bm.Case("softmax + bias", _fwd_bwd(_softmax_bias, (0, 1, 2, 3)), _softmax_inputs(n))
    )
    cases += list(extra(n)) if extra else []
    got = bm.measure_group(cases, min_time_s=0.0, min_runs=rounds, max_runs=rounds)
    soft = got["softmax + bias"].time_s
    row = {
        c.key: {"ms": 1e3 * got[c.key].time_s, "vs_softmax": got[c.key].time_s / soft}
        for c in cases
    }
    out[n] = row
    log(
        f"N={n}: "
        + ", ".join(f"{k} {r['ms']:.0f} ms ({r['vs_softmax']:.2f}x)" for k, r in row.items())
    )
  return out


# ---------------------------------------------------------------------------------------------
# Goals, report, main
# ---------------------------------------------------------------------------------------------
def goals(linear, memory, timing) -> list[dict]:
  """Each goal with its measured value and PASS / FAIL."""
  out = []

  def goal(text, value, ok):
    out.append({"goal": text, "measured": value, "pass": bool(ok)})

  for n, row in linear.items():
    frac = row["rows"]["bidirectional"]["fraction_of_peak"]
    goal(
        f"bidirectional linear attention fwd+bwd >= 50% of the matmul peak at N={n}",
        f"{100 * frac:.0f}% ({row['rows']['bidirectional']['gflops']:.1f} of "
        f"{row['peak_gflops']:.1f} GFLOP/s)",
        frac >= 0.5,
    )
    r = row["rows"]["causal"]["ms"] / row["rows"]["causal Performer scan"]["ms"]
    goal(
        f"causal linear attention fwd+bwd faster than the Performer per-token scan at N={n}",
        f"{r:.2f}x the scan's time",
        r < 1.0,
    )
  for n, row in memory.items():
    worst = max(r["ratio"] for r in row.values())
    goal(
        f"kernelized RPE backward temp memory within 2x of the Toeplitz product at N={n}",
        ", ".join(f"{k} {r['ratio']:.2f}x" for k, r in row.items()),
        worst <= 2.0,
    )
  above = [n for n in timing if n >= 2048]
  for n in above:
    r = timing[n]["kRPE auto"]["vs_softmax"]
    goal(
        f"kernelized RPE fwd+bwd no slower than dense softmax + bias at N={n} (crossover "
        f"at N <= 2K)",
        f"{r:.2f}x softmax's time",
        r <= 1.0,
    )
  return out


def markdown(result) -> str:
  lines = [
      "# Linear attention at matmul speed, kernelized RPE as lean as the Toeplitz product",
      "",
      f"`{result['command']}` on {result['machine']}, float32, batch {BATCH}, "
      f"{HEADS} heads, head dim {DIM}, m = {FEATURES} (kRPE m = {RPE_FEATURES}); "
      f"{result['date']}. Times are medians of interleaved runs in one process; the "
      "machine was shared (load average at start "
      f"{result['load_average']}), so compare within a row group only.",
      "",
      "## Goals",
      "",
      "| goal | measured | result |",
      "|---|---|---|",
  ]
  lines += [
      f"| {g['goal']} | {g['measured']} | {'PASS' if g['pass'] else 'FAIL'} |"
      for g in result["goals"]
  ]
  lines += [
      "",
      "## Linear attention fwd+bwd against the matmul peak",
      "",
      f"Flops counted: 12 N m (d + 1) per batch and head (module docstring). Peak: one "
      f"{PEAK_SIZE}^3 `jnp.dot`, measured in the same group as each length's rows. "
      '"previous": the implementation before this change (einsums in the '
      "[b, n, h, .] layout; causal: serial scan with per-chunk transposes), kept in "
      "the benchmark module for this comparison.",
      "",
      "| N | peak GFLOP/s | row | ms | GFLOP/s | % of peak | temp MiB |",
      "|---|---|---|---|---|---|---|",
  ]
  for n, row in result["linear"].items():
    for k, r in row["rows"].items():
      lines.append(
          f"| {n} | {row['peak_gflops']:.1f} | {k} | {r['ms']:.1f} | "
          f"{r['gflops']:.1f} | {100 * r['fraction_of_peak']:.0f}% | "
          f"{r['temp_mib']:.1f} |"
      )
  lines += [
      "",
      "## Kernelized RPE: backward temporary memory against the Toeplitz product",
      "",
      "Compiled `jax.grad` of kernelized RPE (FFT path; B=1, 8 heads, m=32, d=64) "
      "against `toeplitz_matmul` over `[1, 8, N, 64]` (the channels of v), "
      "`memory_analysis().temp_size_in_bytes`. Before this change (7b4ba12, measured "
      "by the same function in this session): 5.14x / 4.49x (bidirectional / causal) "
      "at 4K and 5.14x / 4.14x at 16K.",
      "",
      "| N | variant | kRPE MiB | Toeplitz MiB | ratio |",
      "|---|---|---|---|---|",
  ]
  for n, row in result["rpe_memory"].items():
    for k, r in row.items():
      lines.append(
          f"| {n} | {k} | {r['krpe_mib']:.1f} | {r['toeplitz_mib']:.1f} | " f"{r['ratio']:.2f}x |"
      )
  lines += [
      "",
      "## Kernelized RPE fwd+bwd against dense softmax with a bias",
      "",
      '"auto": the path the op picks by shape (dense up to N = '
      f'{attention._RPE_DENSE_UP_TO}, FFT above); "fft" and "dense" force one '
      "path. Softmax: `softmax_attention` with the table's log as a [h, N, N] bias.",
      "",
      "| N | row | ms | time / softmax |",
      "|---|---|---|---|",
  ]
  for n, row in result["rpe_time"].items():
    for k, r in row.items():
      lines.append(f"| {n} | {k} | {r['ms']:.0f} | {r['vs_softmax']:.2f}x |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=None, help="folder for the .md / .json (none: print only)")
  # An empty list ("") skips that part.
  p.add_argument("--linear_lengths", default="4096,8192,16384")
  p.add_argument("--memory_lengths", default="4096,16384,65536")
  p.add_argument("--time_lengths", default="512,1024,2048,4096")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--name", default="ops_lean", help="output file stem (<out>/<name>.md, .json)")
  args = p.parse_args(argv)
  try:
    lengths = [
        [int(x) for x in a.split(",") if x.strip()]
        for a in (args.linear_lengths, args.memory_lengths, args.time_lengths)
    ]
  except ValueError:
    print("lengths must be comma-separated integers, e.g. 4096,8192", file=sys.stderr)
    return 2
  log = lambda text: print(text, flush=True)
  result = {
      "command": "python -m fastpos.bench.ops_lean "
      + " ".join(sys.argv[1:] if argv is None else argv),
      "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
      f"{jax.devices()[0].platform}",
      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
      "load_average": " ".join(f"{x:.1f}" for x in os.getloadavg()),
  }
  result["linear"] = measure_linear(lengths[0], log, args.rounds)
  result["rpe_memory"] = measure_rpe_memory(lengths[1], log)
  result["rpe_time"] = measure_rpe_time(lengths[2], log, args.rounds)
  result["goals"] = goals(result["linear"], result["rpe_memory"], result["rpe_time"])
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
      json.dump(result, f, indent=1, default=str)
  text = markdown(result)
  print(text)
  if args.out:
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
      f.write(text)
  return 0 if all(g["pass"] for g in result["goals"]) else 1


if __name__ == "__main__":
  sys.exit(main())
