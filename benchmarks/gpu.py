"""The GPU check: one short run that records, on the device JAX sees, what the CPU tables
record on the 2-core box: ``python -m benchmarks gpu --out DIR`` (``scripts/gpu_check.sh``).

Seven parts, each in its own try block (one failing loses none of the others), each written to
``<out>/gpu.md`` and ``<out>/gpu.json`` as soon as it ends:

  modes, layer, lm_step
              linear attention by algorithm (causal ``recurrent`` / ``chunk`` / ``fused``
              against bidirectional, the bandwidth floor and causal softmax, float32 and
              bf16, N = 1K-64K, batch 1 and 8), the causal ELU+1 + FastRPB layer against
              cuDNN causal attention, and a decoder-LM train step (``benchmarks.gpu_modes``);
  memory      the LRA Text model's train step (``benchmarks.memory``: SIKF + absolute +
              FastRPB, 4 layers x 256), compiled only, for model.remat none / block x
              model.scan_layers off / on x model.mlp_chunk off / on: ``memory_analysis`` at the
              paper setting (batch 32, N = 4000) and at batch 1, N = 16384 (temporary bytes per
              token per layer), and the longest batch-1 N in 16 GiB predicted from the two
              (memory is affine in tokens; not confirmed by compiling);
  train_step  steps/s and tokens/s of that model's train step at the paper setting, as it is
              and as configs/lra_text_fastrpb.py runs it (block remat, scanned, mlp_chunk
              2048), beside the softmax Transformer (``benchmarks.models.train_case``);
  rpe         kernelized RPE (the path the op picks, the FFT path, the dense path, and the FFT
              path stepped both ways: one batched transform and the CPU's serial steps,
              ``attention._rpe_group``) against dense softmax with a bias, the Toeplitz product
              of FastRPB and bidirectional linear attention, fwd+bwd at N = 2K-16K
              (``benchmarks.ops_lean.measure_rpe_time``), and kernelized RPE's backward
              temporary memory, both ways, against the Toeplitz product
              (``measure_rpe_memory``);
  linear      bidirectional and causal linear attention fwd+bwd GFLOP/s against the matmul
              peak measured in the same group (``ops_lean.measure_linear``) at N = 4K-16K,
              batch 1 and 8; the peak both at JAX's default precision and at ``HIGHEST`` (true
              float32), and whether the default rounds float32 operands (TF32).

Times are medians of interleaved runs after a warm-up (``benchmarks.measure``). The timed
parts run first, the memory part last. A global ``--budget-s`` and per-part caps stop a part
between its lengths (what is left is marked skipped). ``--smoke``: tiny sizes, for a check on
the CPU. Exit 0 when every part ran and every goal passed, 1 otherwise, 2 for a bad flag (one
line).

``--rpe-steps N1,N2,..`` measures only kernelized RPE's FFT path stepped both ways, side by
side (``measure_rpe_steps``), and writes ``<out>/rpe_steps.md`` and ``.json``: the check that a
change of the step policy leaves no backend slower. ``--softmax-impls N1,N2,..`` measures only
``softmax_attention``'s implementations side by side (``measure_softmax_impls``) and writes
``<out>/softmax_impls.md`` and ``.json``: what ``implementation="auto"`` picks per backend.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks import gpu_modes, ops_lean, report
from benchmarks import measure as bm
from benchmarks import memory as bench_memory
from benchmarks import models as bench_models
from benchmarks import ops as bench_ops
from fastpos.ops import attention

PARTS = ("modes", "layer", "lm_step", "memory", "train_step", "rpe", "linear")
# The goals' parts first (linear attention by mode, the causal layer, the LM step), then the
# others; the timed parts before the memory part: compiles that the memory part leaves running
# past its deadline (they cannot be stopped) then disturb no timing.
RUN_ORDER = ("modes", "layer", "lm_step", "rpe", "linear", "train_step", "memory")
CAPS_S = {
    "modes": 140.0,
    "layer": 40.0,
    "lm_step": 60.0,
    "rpe": 100.0,
    "linear": 40.0,
    "train_step": 40.0,
    "memory": 60.0,
}
COMMITTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu")  # benchmarks/gpu
LRA_ROW = "Linear SIKF + FastRPB (configs/lra_text_fastrpb.py)"


@dataclasses.dataclass(frozen=True)
class Sizes:
  memory_length: int  # batch-1 N of the per-token figure
  paper: tuple[int, int]  # (batch, N) of the paper setting
  mlp_chunk: int  # model.mlp_chunk of the "on" settings
  rpe_lengths: tuple[int, ...]
  rpe_memory_lengths: tuple[int, ...]
  linear_lengths: tuple[int, ...]
  linear_batches: tuple[int, ...]
  peak_size: int  # square matmul of the peak
  rounds: int  # timed runs per case (train step, rpe)
  linear_rounds: int  # timed runs per case (linear; its Performer row is a per-token scan)
  budget_gib: float = 16.0
  granularity: int = 4096  # of the predicted longest N


FULL = Sizes(
    memory_length=16384,
    paper=(32, 4000),
    mlp_chunk=2048,
    rpe_lengths=(2048, 4096, 8192, 16384),
    rpe_memory_lengths=(4096, 16384, 65536),
    linear_lengths=(4096, 8192, 16384),
    linear_batches=(1, 8),
    peak_size=8192,
    rounds=5,
    linear_rounds=3,
)
SMOKE = Sizes(
    memory_length=64,
    paper=(2, 48),
    mlp_chunk=16,
    rpe_lengths=(32,),
    rpe_memory_lengths=(32,),
    linear_lengths=(64,),
    linear_batches=(1, 2),
    peak_size=64,
    rounds=1,
    linear_rounds=1,
    budget_gib=0.001,
    granularity=16,
)


class Deadline:
  """Seconds left until ``limit_s`` from now (``inf`` when ``limit_s`` is 0 or less)."""

  def __init__(self, limit_s: float):
    self.end = time.monotonic() + limit_s if limit_s > 0 else float("inf")

  def left(self) -> float:
    return self.end - time.monotonic()


# ---------------------------------------------------------------------------------------------
# Part 1: train-step memory against remat x scan x mlp_chunk (compiled only)
# ---------------------------------------------------------------------------------------------
def memory_settings(chunk: int) -> list[tuple[str, bool, int]]:
  """remat x scan_layers x mlp_chunk, the most telling first (they compile first)."""
  return [
      ("none", False, 0),
      ("block", False, 0),
      ("block", True, chunk),
      ("block", True, 0),
      ("none", True, 0),
      ("block", False, chunk),
      ("none", False, chunk),
      ("none", True, chunk),
  ]


def _memory_job(setting, batch: int, length: int, smoke: bool):
  remat, scan, chunk = setting
  fields = bench_memory.model_fields(remat, scan, smoke=smoke, mlp_chunk=chunk)
  mem, secs = bench_memory.compile_step(fields, batch, length)
  return {
      "temp_bytes": int(mem.temp_size_in_bytes),
      "total_bytes": bench_memory.total_bytes(mem),
      "compile_s": secs,
      "layers": fields["num_layers"],
  }


def run_memory(sizes: Sizes, deadline: Deadline, log, smoke: bool) -> dict:
  """Compiles every setting at the paper setting and at batch 1 (the paper ones first), in
  threads (compilation releases the GIL); what is not done by the deadline is left out."""
  settings = memory_settings(sizes.mlp_chunk)
  shapes = {"paper": sizes.paper, "one": (1, sizes.memory_length)}
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))
  futures = {
      pool.submit(_memory_job, s, *shapes[kind], smoke): (kind, s)
      for kind in ("paper", "one")
      for s in settings
  }
  got, errors = {}, {}
  try:
    for fut in concurrent.futures.as_completed(futures, timeout=max(deadline.left(), 1.0)):
      kind, s = futures[fut]
      try:
        got[(kind, s)] = fut.result()
        log(f"  {kind} remat={s[0]} scan={s[1]} mlp_chunk={s[2]}: {_gb(got[(kind, s)])}")
      except Exception as e:  # one setting failing to compile keeps the others
        errors[(kind, s)] = _one_line(e)
        log(f"  {kind} {s}: FAILED {errors[(kind, s)]}")
  except concurrent.futures.TimeoutError:
    log("  memory: time budget reached; settings not compiled by then are left out")
  pool.shutdown(wait=False, cancel_futures=True)
  rows = [_memory_row(s, got, errors, sizes) for s in sorted(settings, key=_setting_order)]
  return {"settings": rows, "paper": sizes.paper, "length": sizes.memory_length}


def _setting_order(s) -> tuple:
  return (s[2], s[1], s[0] != "none")


def _memory_row(s, got, errors, sizes: Sizes) -> dict:
  row = {"remat": s[0], "scan_layers": s[1], "mlp_chunk": s[2]}
  paper, one = got.get(("paper", s)), got.get(("one", s))
  if paper:
    tokens = sizes.paper[0] * sizes.paper[1]
    row |= {
        "paper_bytes": paper["total_bytes"],
        "paper_temp_bytes": paper["temp_bytes"],
        "paper_temp_per_token_layer": paper["temp_bytes"] / (tokens * paper["layers"]),
        "paper_compile_s": paper["compile_s"],
    }
  if one:
    row |= {
        "one_total_bytes": one["total_bytes"],
        "temp_per_token_layer": one["temp_bytes"] / (sizes.memory_length * one["layers"]),
    }
  if paper and one:
    row["longest_n_predicted"] = _affine_longest(
        (sizes.memory_length, one["total_bytes"]),
        (sizes.paper[0] * sizes.paper[1], paper["total_bytes"]),
        sizes.budget_gib * 2**30,
        sizes.granularity,
    )
  missing = [f"{k}: {errors[(k, s)]}" for k in ("paper", "one") if (k, s) in errors]
  if missing:
    row["errors"] = missing
  return row


def _affine_longest(a, b, budget: float, step: int) -> int | None:
  """The largest multiple of ``step`` whose bytes, on the line through the (tokens, bytes)
  points ``a`` and ``b``, stay within ``budget``; None when the line does not rise."""
  (t0, m0), (t1, m1) = a, b
  if m1 <= m0 or t1 == t0:
    return None
  return int((t0 + (budget - m0) * (t1 - t0) / (m1 - m0)) // step * step)


def memory_goals(part: dict) -> list[dict]:
  rows = [r for r in part["settings"] if "paper_bytes" in r]
  out = []
  if rows:
    best = min(rows, key=lambda r: r["paper_bytes"])
    out.append(
        _goal(
            f"LRA Text paper setting (batch {part['paper'][0]}, N={part['paper'][1]}) under "
            f"{bench_memory.GOAL_PAPER_BYTES / 1e9:g} GB",
            f"{best['paper_bytes'] / 1e9:.2f} GB ({_setting(best)})",
            best["paper_bytes"] < bench_memory.GOAL_PAPER_BYTES,
        )
    )
  by = {(r["remat"], r["scan_layers"], r["mlp_chunk"]): r for r in rows}
  none, block = by.get(("none", False, 0)), by.get(("block", False, 0))
  if none and block:
    ratio = block["paper_temp_bytes"] / none["paper_temp_bytes"]
    out.append(
        _goal(
            "block remat realised without scan (unrolled: block temp below 0.9x none's)",
            f"{ratio:.2f}x ({block['paper_temp_bytes'] / 1e9:.2f} vs "
            f"{none['paper_temp_bytes'] / 1e9:.2f} GB temp)",
            ratio < 0.9,
        )
    )
  return out


# ---------------------------------------------------------------------------------------------
# Part 2: the LRA Text train step at the paper setting
# ---------------------------------------------------------------------------------------------
def train_rows(chunk: int) -> list[bench_models.Model]:
  """The softmax Transformer (baseline), the LRA Text model as the bench builds it, and the
  same with configs/lra_text_fastrpb.py's memory settings."""
  rows = {m.name: m for m in bench_models.train_models(32)}
  lra = rows[LRA_ROW]
  lean = dataclasses.replace(
      lra,
      name=f"Linear SIKF + FastRPB, remat=block, scan_layers, mlp_chunk={chunk}",
      fields=(("remat", "block"), ("scan_layers", True), ("mlp_chunk", chunk)),
  )
  return [rows["Transformer (softmax)"], lra, lean]


def run_train_step(sizes: Sizes, log, smoke: bool) -> dict:
  batch, length = sizes.paper
  args = argparse.Namespace(
      train_length=length, train_batch=batch, num_features=32, dtype="float32", smoke=smoke
  )
  models = train_rows(sizes.mlp_chunk)
  stats = bm.device_memory_stats()
  limit = 0.9 * stats["bytes_limit"] if stats and "bytes_limit" in stats else float("inf")
  got = bm.measure_group(
      [bench_models.train_case(m, args) for m in models],
      limits=bm.Limits(max_memory_bytes=limit),
      min_time_s=0.0 if smoke else 1.0,
      min_runs=sizes.rounds,
      max_runs=2 * sizes.rounds,
  )
  base = got[models[0].name]
  rows = []
  for m in models:
    r = got[m.name]
    row = {"model": m.name, "fields": dict(m.fields)} | r.as_dict()
    if r.time_s:
      row |= {"steps_per_s": 1 / r.time_s, "tokens_per_s": batch * length / r.time_s}
      if base.time_s:
        row["time_vs_transformer"] = r.time_s / base.time_s
    rows.append(row)
    log(f"  {m.name}: {_step_text(row)}")
  return {"batch": batch, "length": length, "rows": rows}


# ---------------------------------------------------------------------------------------------
# Part 3: kernelized RPE against softmax + bias and the Toeplitz product
# ---------------------------------------------------------------------------------------------
# The FFT path's two step policies (``attention._rpe_group``), by the backend whose policy they
# are: every head and feature in one batched transform (GPU / TPU), or one head's group of
# features per step of a serial loop (CPU).
RPE_STEPS = {"one batch": "gpu", "CPU steps": "cpu"}
RPE_SLOWER_AT_MOST = 0.25  # kRPE's time over softmax + bias's at the longest N (16K)


@contextlib.contextmanager
def rpe_steps(backend: str):
  """While active (around tracing), kernelized RPE's FFT path steps as on ``backend``,
  whatever the device."""
  saved = attention._rpe_group, attention._rpe_fft_bytes
  attention._rpe_group = functools.partial(saved[0], backend=backend)
  attention._rpe_fft_bytes = functools.partial(saved[1], backend=backend)
  try:
    yield
  finally:
    attention._rpe_group, attention._rpe_fft_bytes = saved


def _steps_cases(n: int) -> list[bm.Case]:
  """The FFT path fwd+bwd under each step policy (``RPE_STEPS``), on the rows' inputs."""
  out = []
  for label, backend in RPE_STEPS.items():
    fft = ops_lean._krpe("fft")

    def fn(*args, fft=fft, backend=backend):
      with rpe_steps(backend):
        return fft(*args)

    out.append(
        bm.Case(f"kRPE FFT, {label}", ops_lean._fwd_bwd(fn, (0, 1, 2, 3)), ops_lean._rpe_inputs(n))
    )
  return out


def _peer_cases(n: int) -> list[bm.Case]:
  """FastRPB's Toeplitz product over ``[1, 8, N, 64]`` and bidirectional ELU+1 linear
  attention (m = 64), fwd+bwd, built by ``benchmarks.ops``; and the FFT path under each
  step policy."""
  out = []
  for key, build in (
      ("toeplitz (FastRPB product)", bench_ops._toeplitz_1d(False)),
      ("linear attention (m=64)", bench_ops._linear(False, False)),
  ):
    fn, make, argnums = build(n, jnp.float32)
    g, make_ct = bench_ops.with_backward(fn, make, argnums)
    out.append(bm.Case(key, g, make_ct))
  return out + _steps_cases(n)


def step_channel_mib(n: int, backend: str) -> float:
  """MiB of the channels of one step of the FFT path at the rows' shape, float32."""
  b, h, m, d = ops_lean.BATCH, ops_lean.HEADS, ops_lean.RPE_FEATURES, ops_lean.DIM
  heads, group = attention._rpe_group(b, n, h, m, d, 4, backend)
  return b * heads * n * group * (d + 1) * 4 / 2**20


def run_rpe(sizes: Sizes, deadline: Deadline, log) -> dict:
  timing, memory, errors = {}, {}, {}
  for n in sizes.rpe_lengths:
    if deadline.left() <= 0:
      errors[f"time {n}"] = "skipped: time budget"
      continue
    try:
      timing |= ops_lean.measure_rpe_time([n], log, sizes.rounds, extra=_peer_cases)
    except Exception as e:  # a length that does not fit keeps the others
      errors[f"time {n}"] = _one_line(e)
      log(f"  N={n}: FAILED {errors[f'time {n}']}")
  for n in sizes.rpe_memory_lengths:
    for label, backend in RPE_STEPS.items():
      if deadline.left() <= 0:
        errors[f"memory {n}, {label}"] = "skipped: time budget"
        continue
      try:
        with rpe_steps(backend):
          got = ops_lean.measure_rpe_memory([n], log)[n]
        for k, r in got.items():
          r["step_channel_mib"] = step_channel_mib(n, backend)
          memory.setdefault(n, {})[f"{k}, {label}"] = r
      except Exception as e:
        errors[f"memory {n}, {label}"] = _one_line(e)
  backend = jax.default_backend()
  limit = attention._RPE_DENSE_UP_TO_GPU if backend == "gpu" else attention._RPE_DENSE_UP_TO
  return {
      "time": timing,
      "memory": memory,
      "errors": errors,
      "dense_limit": {"backend": backend, "dense_up_to": limit},
  }


def measure_rpe_steps(lengths, rounds: int, log) -> dict:
  """fwd+bwd ms of the FFT path under each step policy, one interleaved group per length
  (``rounds`` timed runs of each, medians), with the ratio to the CPU steps."""
  out = {}
  for n in lengths:
    got = bm.measure_group(_steps_cases(n), min_time_s=0.0, min_runs=rounds, max_runs=rounds)
    base = got["kRPE FFT, CPU steps"].time_s
    out[n] = {
        k: {
            "ms": 1e3 * r.time_s,
            "vs_cpu_steps": r.time_s / base,
            "times_ms": [1e3 * t for t in r.times_s],
        }
        for k, r in got.items()
    }
    log(
        f"N={n}: "
        + ", ".join(f"{k} {r['ms']:.0f} ms ({r['vs_cpu_steps']:.2f}x)" for k, r in out[n].items())
    )
  return out


def timed_rows_markdown(
    title: str, run: dict, setup: str, rows: dict, *, base: str, ratio: str
) -> str:
  """A section of timed rows: ``# title``, the run's provenance (``report.provenance``), what
  was timed (``setup``), then a line per N and row of ``rows`` (``{N: {row: {"ms", ratio,
  "times_ms"}}}``, as ``measure_rpe_steps`` and ``measure_softmax_impls`` give them): its
  median, its time over that of the row ``base`` of the same N (``row[ratio]``), its runs."""
  lines = [
      f"# {title}",
      "",
      report.provenance(run) + ".",
      "",
      setup,
      "",
      f"| N | row | ms | time / {base} | runs (ms) |",
      "|---:|---|---:|---:|---|",
  ]
  for n, row in sorted(rows.items()):
    for k, r in row.items():
      runs = ", ".join(f"{t:.0f}" for t in r["times_ms"])
      lines.append(f"| {n} | {k} | {r['ms']:.0f} | {r[ratio]:.2f}x | {runs} |")
  return "\n".join(lines)


def rpe_steps_markdown(run: dict, rows: dict) -> str:
  setup = (
      f"fwd+bwd of `linear_attention(rpe=...)` forced onto its FFT path, batch {ops_lean.BATCH},"
      f" {ops_lean.HEADS} heads, m = {ops_lean.RPE_FEATURES}, d = {ops_lean.DIM}, float32; "
      "each N one group of interleaved runs (medians). 'CPU steps': one head's group of "
      "features per step of a serial loop (the CPU's policy); 'one batch': every head and "
      "feature in one step (the GPU / TPU policy), both forced whatever the device "
      "(`benchmarks.gpu.rpe_steps`)."
  )
  title = "Kernelized RPE's FFT path: one batched transform against serial steps"
  return timed_rows_markdown(title, run, setup, rows, base="CPU steps", ratio="vs_cpu_steps")


SOFTMAX_SETTINGS = {"plain": {}, "causal + bias": {"causal": True, "bias": True}}


def _softmax_case(n: int, impl: str, setting: str) -> bm.Case:
  opts = SOFTMAX_SETTINGS[setting]
  h, d = ops_lean.HEADS, ops_lean.DIM

  def fn(q, k, v, b):
    bias = b if opts.get("bias") else None
    return attention.softmax_attention(
        q, k, v, bias=bias, causal=opts.get("causal", False), implementation=impl
    )

  make = lambda: tuple(bm.pseudo_normal(i, (1, n, h, d)) for i in range(3)) + (
      bm.pseudo_normal(3, (h, n, n), scale=0.1),
  )
  g, make_ct = bench_ops.with_backward(fn, make, (0, 1, 2, 3) if opts.get("bias") else (0, 1, 2))
  return bm.Case(f"{setting}, {impl}", g, make_ct)


def measure_softmax_impls(lengths, rounds: int, log, impls=("einsum", "jax")) -> dict:
  """fwd+bwd ms of ``softmax_attention`` under each implementation (batch 1, 8 heads, d = 64,
  float32), plain and causal with a bias, one interleaved group per length (``rounds`` timed
  runs of each, medians), with the ratio to the first implementation of the same setting."""
  out = {}
  for n in lengths:
    cases = [_softmax_case(n, i, s) for s in SOFTMAX_SETTINGS for i in impls]
    got = bm.measure_group(cases, min_time_s=0.0, min_runs=rounds, max_runs=rounds)
    row = {}
    for s in SOFTMAX_SETTINGS:
      base = got[f"{s}, {impls[0]}"].time_s
      for i in impls:
        r = got[f"{s}, {i}"]
        row[f"{s}, {i}"] = {
            "ms": 1e3 * r.time_s,
            f"vs_{impls[0]}": r.time_s / base,
            "times_ms": [1e3 * t for t in r.times_s],
        }
    out[n] = row
    log(f"N={n}: " + ", ".join(f"{k} {r['ms']:.0f} ms" for k, r in row.items()))
  return out


def softmax_impls_markdown(run: dict, rows: dict, impls=("einsum", "jax")) -> str:
  setup = (
      f"fwd+bwd (grad of every input, the bias included) of `softmax_attention(implementation="
      f"...)`, batch 1, {ops_lean.HEADS} heads, d = {ops_lean.DIM}, float32; plain, and causal "
      "with a [heads, N, N] bias; each N one group of interleaved runs (medians). 'einsum': two "
      "einsums and a softmax; 'jax': `jax.nn.dot_product_attention` (XLA here; cuDNN on GPUs "
      f'for bf16 / fp16). `implementation="auto"` on {jax.default_backend()} runs '
      f"\"{attention._softmax_implementation('auto', jnp.float32)}\"."
  )
  title = "softmax_attention: its implementations side by side"
  return timed_rows_markdown(title, run, setup, rows, base=impls[0], ratio=f"vs_{impls[0]}")


def rpe_goals(part: dict) -> list[dict]:
  out = []
  rows = _by_int(part["time"])
  for key, what in (("kRPE auto", "as the op picks it"), ("kRPE fft", "FFT path")):
    ratios = [(n, row[key]["vs_softmax"]) for n, row in rows if n >= 2048 and key in row]
    if ratios:
      out.append(
          _goal(
              f"kernelized RPE ({what}) fwd+bwd no slower than softmax + bias at every N >= 2K",
              ", ".join(f"{n}: {r:.2f}x" for n, r in ratios),
              all(r <= 1.0 for _, r in ratios),
          )
      )
    last = [r for n, r in ratios if n == 16384]
    if last:
      out.append(
          _goal(
              f"kernelized RPE ({what}) fwd+bwd at most {RPE_SLOWER_AT_MOST}x softmax + bias's "
              "time at N = 16K",
              f"{last[0]:.2f}x",
              last[0] <= RPE_SLOWER_AT_MOST,
          )
      )
  for n, row in _by_int(part["memory"]):
    # Records from before the one-batch rows name no policy: their rows ran in steps.
    lean = {k: r for k, r in row.items() if not k.endswith("one batch")}
    if lean:
      out.append(
          _goal(
              f"kernelized RPE (in steps) backward temp memory within 2x of the Toeplitz "
              f"product at N={n}",
              ", ".join(f"{k} {r['ratio']:.2f}x" for k, r in lean.items()),
              max(r["ratio"] for r in lean.values()) <= 2.0,
          )
      )
    batch = {k: r for k, r in row.items() if k.endswith("one batch") and "step_channel_mib" in r}
    if batch:
      worst = max(r["krpe_mib"] / r["step_channel_mib"] for r in batch.values())
      out.append(
          _goal(
              f"kernelized RPE (one batch) backward temp memory within 8x one step's channels "
              f"at N={n}",
              ", ".join(
                  f"{k} {r['krpe_mib'] / r['step_channel_mib']:.1f}x of "
                  f"{r['step_channel_mib']:.0f} MiB"
                  for k, r in batch.items()
              ),
              worst <= 8.0,
          )
      )
  return out


def dense_limit_text(part: dict) -> str:
  """Where the dense path beat the FFT path among the measured N, beside the dense limit the
  op used on the run's backend (``attention._rpe_dense_is_faster``), where recorded."""
  rows = _by_int(part["time"])
  dense = [
      n
      for n, row in rows
      if {"kRPE dense", "kRPE fft"} <= set(row) and row["kRPE dense"]["ms"] <= row["kRPE fft"]["ms"]
  ]
  text = f"Dense beat the FFT path at N = {', '.join(map(str, dense)) or 'none measured'}"
  limit = part.get("dense_limit")
  if limit:
    text += (
        f"; the op's dense limit on {limit['backend']}: N <= {limit['dense_up_to']} "
        "(`attention._RPE_DENSE_UP_TO`, `_RPE_DENSE_UP_TO_GPU`)"
    )
  return text + "."


# ---------------------------------------------------------------------------------------------
# Part 4: linear attention against the matmul peak
# ---------------------------------------------------------------------------------------------
def matmul_precision(size: int, rounds: int) -> dict:
  """The float32 matmul peak at the default precision and at HIGHEST, side by side, and
  whether the default rounds the operands (its result differs from HIGHEST's by more than
  float32 accumulation can: TF32 on NVIDIA GPUs)."""
  make = lambda: (
      bm.pseudo_normal(0, (size, size)),
      bm.pseudo_normal(1, (size, size)),
  )
  highest = lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)
  cases = [bm.Case("default", jnp.dot, make), bm.Case("highest", highest, make)]
  got = bm.measure_group(cases, min_time_s=0.0, min_runs=rounds, max_runs=rounds)
  a, b = make()
  d, h = jnp.dot(a, b), highest(a, b)
  rel = float(jnp.linalg.norm(d - h) / jnp.linalg.norm(h))
  flop = 2.0 * size**3
  return {
      "size": size,
      "default_gflops": flop / got["default"].time_s / 1e9,
      "highest_gflops": flop / got["highest"].time_s / 1e9,
      "default_vs_highest_rel_diff": rel,
      "default_is_reduced": rel > 1e-5,
      "jax_default_matmul_precision": str(
          getattr(jax.config, "jax_default_matmul_precision", "unknown")
      ),
  }


def run_linear(sizes: Sizes, deadline: Deadline, log) -> dict:
  out = {"peak": None, "batches": {}, "errors": {}}
  try:
    out["peak"] = matmul_precision(sizes.peak_size, sizes.linear_rounds)
    log(f"  matmul peak: {out['peak']}")
  except Exception as e:
    out["errors"]["peak"] = _one_line(e)
  saved = ops_lean.BATCH, ops_lean.PEAK_SIZE
  try:
    ops_lean.PEAK_SIZE = sizes.peak_size
    for b in sizes.linear_batches:
      ops_lean.BATCH = b
      rows = out["batches"].setdefault(b, {})
      for n in sizes.linear_lengths:
        if deadline.left() <= 0:
          out["errors"][f"batch {b} N={n}"] = "skipped: time budget"
          continue
        try:
          rows |= ops_lean.measure_linear(
              [n], lambda s, b=b: log(f"  batch {b} {s}"), sizes.linear_rounds, repeats=1
          )
        except Exception as e:
          out["errors"][f"batch {b} N={n}"] = _one_line(e)
  finally:
    ops_lean.BATCH, ops_lean.PEAK_SIZE = saved
  return out


def linear_goals(part: dict) -> list[dict]:
  batches = _by_int(part["batches"])
  return ops_lean.goals(batches[0][1], {}, {}) if batches else []


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _goal(text: str, measured: str, ok: bool) -> dict:
  return {"goal": text, "measured": measured, "pass": bool(ok)}


def _one_line(e: BaseException) -> str:
  return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def _gb(x: dict) -> str:
  return f"{x['total_bytes'] / 1e9:.3f} GB total, compiled in {x['compile_s']:.1f} s"


def _setting(r: dict) -> str:
  return f"remat={r['remat']}, scan={r['scan_layers']}, mlp_chunk={r['mlp_chunk']}"


def _step_text(row: dict) -> str:
  if row.get("time_s") is None:
    return row.get("skipped") or "not run"
  return (
      f"{1e3 * row['time_s']:.1f} ms/step, {row['steps_per_s']:.2f} steps/s, "
      f"{row['tokens_per_s']:,.0f} tokens/s"
  )


def machine() -> dict:
  import flax
  import jaxlib
  import optax

  dev = jax.devices()[0]
  return {
      "device": f"{dev.platform}: {dev.device_kind}",
      "device_count": jax.device_count(),
      "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
      "python": platform.python_version(),
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "flax": flax.__version__,
      "optax": optax.__version__,
  }


def _by_int(d: dict) -> list:
  """``d``'s items by integer key (JSON turns the lengths and batches into strings)."""
  return sorted(d.items(), key=lambda kv: int(kv[0]))


def _peak_cell(r: dict) -> str:
  """The allocator's peak of a row; "<=" where the row did not raise the high-water mark (an
  earlier row of the group had: then only a bound)."""
  if r.get("device_peak_bytes") is None:
    return "-"
  return ("<= " if r.get("device_peak_is_bound") else "") + _fmt_gb(r["device_peak_bytes"])


def _fmt_gb(b) -> str:
  return "-" if b is None else f"{b / 1e9:.2f} GB"


def _kb(b) -> str:
  return "-" if b is None else f"{b / 1e3:.1f}"


def _memory_md(part: dict) -> list[str]:
  b, n = part["paper"]
  lines = [
      f"| remat | scan_layers | mlp_chunk | paper setting (b={b}, N={n}) total | its temp "
      f"KB / token / layer | batch-1 N={part['length']} temp KB / token / layer | longest "
      "batch-1 N in 16 GiB (predicted) |",
      "|---|---|---:|---:|---:|---:|---:|",
  ]
  for r in part["settings"]:
    longest = r.get("longest_n_predicted")
    lines.append(
        f"| {r['remat']} | {r['scan_layers']} | {r['mlp_chunk']} | "
        f"{_fmt_gb(r.get('paper_bytes'))} | {_kb(r.get('paper_temp_per_token_layer'))} | "
        f"{_kb(r.get('temp_per_token_layer'))} | "
        f"{'-' if longest is None else f'{longest:,}'} |"
        + (f" {'; '.join(r['errors'])}" if r.get("errors") else "")
    )
  return lines


def _train_md(part: dict) -> list[str]:
  lines = [
      "| model | ms / step | steps/s | tokens/s | time vs Transformer | compiled memory | "
      "device peak |",
      "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in part["rows"]:
    if r.get("time_s") is None:
      lines.append(f"| {r['model']} | {r.get('skipped') or 'not run'} | | | | | |")
      continue
    lines.append(
        f"| {r['model']} | {1e3 * r['time_s']:.1f} | {r['steps_per_s']:.2f} | "
        f"{r['tokens_per_s']:,.0f} | {r.get('time_vs_transformer', 0):.2f}x | "
        f"{_fmt_gb(r.get('memory_bytes'))} | {_peak_cell(r)} |"
    )
  return lines


def _rpe_md(part: dict) -> list[str]:
  lines = ["| N | row | fwd+bwd ms | time / softmax + bias |", "|---:|---|---:|---:|"]
  for n, row in _by_int(part["time"]):
    lines += [f"| {n} | {k} | {r['ms']:.2f} | {r['vs_softmax']:.2f}x |" for k, r in row.items()]
  if part["time"]:
    lines += ["", dense_limit_text(part)]
  lines += ["", "| N | variant | kRPE temp MiB | Toeplitz temp MiB | ratio | step channels MiB |"]
  lines += ["|---:|---|---:|---:|---:|---:|"]
  for n, row in _by_int(part["memory"]):
    lines += [
        f"| {n} | {k} | {r['krpe_mib']:.1f} | {r['toeplitz_mib']:.1f} | {r['ratio']:.2f}x | "
        + (f"{r['step_channel_mib']:.1f} |" if "step_channel_mib" in r else "- |")
        for k, r in row.items()
    ]
  return lines


def _linear_md(part: dict) -> list[str]:
  lines = []
  p = part.get("peak")
  if p:
    lines += [
        f"Matmul peak ({p['size']}^3 float32 `jnp.dot`): {p['default_gflops']:,.0f} GFLOP/s at "
        f"JAX's default precision, {p['highest_gflops']:,.0f} at `HIGHEST`; the default's "
        f"result differs from HIGHEST's by {p['default_vs_highest_rel_diff']:.1e} relative, "
        f"so the default {'rounds operands (TF32)' if p['default_is_reduced'] else 'is float32'} "
        f"(jax_default_matmul_precision = {p['jax_default_matmul_precision']}).",
        "",
    ]
  lines += [
      "| batch | N | default-precision peak GFLOP/s (same group) | row | ms | GFLOP/s | % of "
      "that peak | % of HIGHEST peak |",
      "|---:|---:|---:|---|---:|---:|---:|---:|",
  ]
  for b, rows in _by_int(part["batches"]):
    for n, row in _by_int(rows):
      for k, r in row["rows"].items():
        hi = f"{100 * r['gflops'] / p['highest_gflops']:.1f}%" if p else "-"
        lines.append(
            f"| {b} | {n} | {row['peak_gflops']:,.0f} | {k} | {r['ms']:.2f} | "
            f"{r['gflops']:,.0f} | {100 * r['fraction_of_peak']:.1f}% | {hi} |"
        )
  return lines


NOTES = {
    "modes": "Inputs [batch, N, 8, 64] token-major (features positive, as ELU+1 gives), m = d = "
    "64; fwd+bwd of the op by `mode`, beside the bidirectional op, the copy of the bytes the "
    "fwd+bwd must read and write (the bandwidth floor) and causal softmax attention "
    "(`jax.nn.dot_product_attention`: cuDNN on a GPU in bf16, XLA otherwise); one interleaved "
    "group per (dtype, batch, N); a mode that does not build a cell says why.",
    "layer": "`fastpos.attention(512, 8, kernel='elu1', positional='fastrpb', causal=True)` "
    "(mode auto) against the same projections around `jax.nn.dot_product_attention(is_causal="
    "True)`, batch 1, bf16 activations.",
    "lm_step": "`DecoderLM` (2 layers x 512, 8 heads, MLP 2048, vocab 257), one AdamW step on "
    "one sequence of N tokens; float32 at the default matmul precision.",
    "memory": "SIKF + absolute + FastRPB, 4 layers x 256, 4 heads, MLP 1024, CLS pooling; "
    "`memory_analysis` of the compiled train step (temp + arguments + outputs - aliased; "
    "parameters and AdamW state donated). KB / token / layer: temporary bytes over tokens x "
    "layers. Longest N: on the line through the two compiled points (memory is affine in "
    "tokens), not confirmed by compiling there.",
    "train_step": "One jitted step (value_and_grad, global-norm clip, AdamW) of "
    "`benchmarks.models.train_case` (mean pooling), float32 at JAX's default matmul "
    "precision; median of interleaved runs after a warm-up. Device peak: the allocator's "
    "high-water mark; '<=' where the row did not raise it (a bound only).",
    "rpe": "Batch 1, 8 heads, head dim 64, kernelized RPE with m = 32 (ELU+1 features), one "
    "interleaved group per N (`benchmarks.ops_lean`); 'auto' is the path the op picks by "
    "shape, 'fft' and 'dense' are forced; 'FFT, one batch' and 'FFT, CPU steps' force the FFT "
    "path's step policy too (every head and feature in one batched transform, the GPU / TPU "
    "policy; one head's group of features per serial step, the CPU's). Memory: compiled "
    "backward temp bytes of the FFT path under each policy against `toeplitz_matmul` over "
    "[1, 8, N, 64], and the channels of one step.",
    "linear": "m = 64, head dim 64, 8 heads; flops 12 N m (d + 1) per batch and head "
    "(`benchmarks.ops_lean`); the peak is one square `jnp.dot`, measured in each N's "
    "group at the default precision.",
}

SECTIONS = {
    "modes": ("Causal linear attention by mode, fwd+bwd (ms)", gpu_modes.modes_md),
    "layer": ("The causal ELU+1 + FastRPB layer against causal softmax, bf16", gpu_modes.layer_md),
    "lm_step": ("Decoder-LM train step: ELU+1 + FastRPB against softmax", gpu_modes.lm_md),
    "memory": ("Train-step memory: remat x scan_layers x mlp_chunk (compiled only)", _memory_md),
    "train_step": ("LRA Text train step at the paper setting", _train_md),
    "rpe": ("Kernelized RPE vs dense softmax + bias vs the Toeplitz product (fwd+bwd)", _rpe_md),
    "linear": ("Linear attention fwd+bwd against the matmul peak", _linear_md),
}


def markdown(result: dict) -> str:
  m = result["machine"]
  lines = [
      "# The GPU check",
      "",
      f"`{result['command']}` on {m['device']} ({m['host']}); python {m['python']}, jax "
      f"{m['jax']} / jaxlib {m['jaxlib']}, flax {m['flax']}, optax {m['optax']}; float32 "
      "unless a row says bf16; "
      f"{result['date']}. Wall time {result.get('wall_s', 0):.0f} s.",
      "",
  ]
  lines += report.goals_table(result["goals"])
  for name in PARTS:
    title, render = SECTIONS[name]
    part = result["parts"].get(name)
    if part is None:
      continue
    lines += ["", f"## {title}", ""]
    if "error" in part:
      lines.append(f"Not measured: {part['error']}")
      continue
    lines += [NOTES[name], ""] + render(part)
    errors = part.get("errors")
    if errors:
      lines += ["", "Left out: " + "; ".join(f"{k}: {v}" for k, v in errors.items())]
  return "\n".join(lines) + "\n"


GOALS = {
    "modes": gpu_modes.modes_goals,
    "layer": gpu_modes.layer_goals,
    "lm_step": gpu_modes.lm_goals,
    "memory": memory_goals,
    "rpe": rpe_goals,
    "linear": linear_goals,
}


def write(out: str, result: dict) -> None:
  result["goals"] = [
      g
      for name, fn in GOALS.items()
      if name in result["parts"] and "error" not in result["parts"][name]
      for g in fn(result["parts"][name])
  ]
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "gpu.json"), "w") as f:
    json.dump(result, f, indent=1, default=str)
  with open(os.path.join(out, "gpu.md"), "w") as f:
    f.write(markdown(result))


def load(path: str) -> dict:
  """A ``gpu.json`` back as ``main`` held it (JSON keeps the lengths and batches as strings)."""
  with open(path) as f:
    result = json.load(f)
  ints = lambda d: {int(k): v for k, v in d.items()}
  rpe, linear = result["parts"].get("rpe", {}), result["parts"].get("linear", {})
  for key in ("time", "memory"):
    if key in rpe:
      rpe[key] = ints(rpe[key])
  if "batches" in linear:
    linear["batches"] = {int(b): ints(rows) for b, rows in linear["batches"].items()}
  return result


def render(path: str) -> None:
  """Rewrites ``gpu.md`` beside ``path`` (a ``gpu.json``) from the numbers in it."""
  result = load(path)
  write(os.path.dirname(os.path.abspath(path)), result)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__.split("\n\n")[0])
  p.add_argument("--out", help="folder for gpu.md / gpu.json (required unless --render)")
  p.add_argument(
      "--render", metavar="GPU_JSON", help="measure nothing: rewrite gpu.md from this gpu.json"
  )
  p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
  p.add_argument("--budget-s", type=float, default=420.0, help="whole run; 0: no limit")
  p.add_argument("--smoke", action="store_true", help="tiny sizes: a check that every part runs")
  p.add_argument(
      "--rpe-steps",
      metavar="N1,N2,..",
      help="measure only kernelized RPE's FFT path under both step policies at these lengths "
      "(writes <out>/rpe_steps.md and .json)",
  )
  p.add_argument(
      "--softmax-impls",
      metavar="N1,N2,..",
      help="measure only softmax_attention's implementations at these lengths (writes "
      "<out>/softmax_impls.md and .json)",
  )
  args = p.parse_args(argv)
  if not args.out and not args.render:
    p.error("give --out (or --render GPU_JSON)")
  parts = [x for x in args.parts.split(",") if x]
  bad = [x for x in parts if x not in PARTS]
  if bad or not parts:
    p.error(f"--parts: unknown {bad or 'none given'}; valid: {', '.join(PARTS)}")
  if args.smoke and args.out and os.path.realpath(args.out) == os.path.realpath(COMMITTED):
    p.error(f"--smoke numbers do not go into {COMMITTED}; give another --out")
  args.parts = parts
  for flag in ("rpe_steps", "softmax_impls"):
    given = getattr(args, flag)
    if given is None:
      continue
    try:
      lengths = [int(x) for x in given.split(",") if x]
    except ValueError:
      lengths = []
    if not lengths or min(lengths) < 1 or not args.out:
      name = "--" + flag.replace("_", "-")
      p.error(f"{name} needs comma-separated positive int lengths and --out; got {given!r}")
    setattr(args, flag, lengths)
  return args


def run_part(name: str, sizes: Sizes, budget: Deadline, smoke: bool, log) -> dict:
  deadline = Deadline(max(min(CAPS_S[name], budget.left()), 1.0))
  mode_sizes = gpu_modes.SMOKE if smoke else gpu_modes.FULL
  if name == "modes":
    return gpu_modes.run_modes(mode_sizes, deadline, log)
  if name == "layer":
    return gpu_modes.run_layer(mode_sizes, deadline, log)
  if name == "lm_step":
    return gpu_modes.run_lm_step(mode_sizes, deadline, log, smoke)
  if name == "memory":
    return run_memory(sizes, deadline, log, smoke)
  if name == "train_step":
    return run_train_step(sizes, log, smoke)
  if name == "rpe":
    return run_rpe(sizes, deadline, log)
  return run_linear(sizes, deadline, log)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.render:
    try:
      render(args.render)
    except (OSError, ValueError, KeyError) as e:
      print(f"gpu: cannot render {args.render}: {_one_line(e)}", file=sys.stderr)
      return 2
    return 0
  sizes = SMOKE if args.smoke else FULL
  budget = Deadline(args.budget_s)
  log = lambda s: print(s, flush=True)
  # The measure-only flags: (lengths, measure, markdown) of each, the first one given runs.
  timed = {
      "rpe_steps": (args.rpe_steps, measure_rpe_steps, rpe_steps_markdown),
      "softmax_impls": (args.softmax_impls, measure_softmax_impls, softmax_impls_markdown),
  }
  for name, (lengths, measure, markdown) in timed.items():
    if lengths:
      run = report.run_record("gpu", argv)
      rows = measure(lengths, sizes.rounds, log)
      table = markdown(run, rows)
      report.write(args.out, name, table, {"run": run, "rows": rows})
      print(table, flush=True)
      return 0
  start = time.monotonic()
  result = {
      "command": report.command("gpu", argv),
      "machine": machine(),
      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
      "smoke": args.smoke,
      "sizes": dataclasses.asdict(sizes),
      "parts": {},
  }
  log(f"gpu check on {result['machine']}")
  ok = True
  for name in [p for p in RUN_ORDER if p in args.parts]:
    if budget.left() <= 0:
      result["parts"][name] = {"error": "skipped: the run's time budget was spent"}
      ok = False
      continue
    log(f"[{name}] start ({time.monotonic() - start:.0f} s into the run)")
    try:
      result["parts"][name] = run_part(name, sizes, budget, args.smoke, log)
    except Exception as e:  # one part failing keeps the others
      traceback.print_exc()
      result["parts"][name] = {"error": _one_line(e)}
      ok = False
    result["wall_s"] = time.monotonic() - start
    write(args.out, result)
    log(f"[{name}] done ({result['wall_s']:.0f} s into the run)")
  print(markdown(result), flush=True)
  ok = ok and all(g["pass"] for g in result["goals"])
  return 0 if ok else 1


if __name__ == "__main__":
  code = main()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # compiles the memory part left running past its deadline end with us
