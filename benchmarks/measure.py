"""How the benchmarks measure: compiled memory, device peaks, interleaved medians.

A ``Case`` is one row of a table at one length: a function and a builder of its inputs. A
group of cases (the rows of one table at one length, or of several tables that share a
length) is measured together:

1. each case is compiled once, ``jax.jit(fn).lower(*specs).compile()`` (the compiles of a
   group run on all cores at once; nothing is timed meanwhile); the executable's
   ``memory_analysis()`` gives temp + argument + output bytes and its ``cost_analysis()`` the
   flops (no inputs are allocated for this: ``specs`` come from ``jax.eval_shape`` of the
   input builder, so memory is reported even where running would take too long); a case
   over the ``Limits`` is not run;
2. the inputs of every case that runs are built (one jit for the group), and each case runs
   once as a warm-up (on a GPU that run also reads the allocator's high-water mark, see
   ``_device_peak``);
3. the timed runs go round-robin over the cases (case 1, case 2, ..., case 1, ...), so load
   from other processes falls on every row alike and ratios within the group hold; each case
   reports the median of its runs. Cases faster than ``PRIMED_BELOW_S`` run twice per round
   and time the second run (see there).

Times are wall-clock seconds around ``block_until_ready`` of a compiled executable: no
tracing, no compilation, no Python dispatch of jit.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Case:
  """One row at one length.

  Attributes:
    key: a unique id within a group (e.g. ``"toeplitz/fft/fwd"``).
    fn: a jittable function of the inputs.
    make_inputs: ``() -> tuple of arrays``; traceable (it is ``eval_shape``-d for memory);
      use ``pseudo_normal`` rather than ``jax.random`` (threefry costs seconds of compile
      per case on a 2-core CPU).
    skip: a reason not to compile or run at all (e.g. the inputs alone exceed memory).
    skip_time: a reason to report memory but not to run (e.g. minutes per run here).
    max_run_s: this case's own ``Limits.max_run_s`` (the rows a target is read from).
  """

  key: str
  fn: Callable
  make_inputs: Callable[[], tuple]
  skip: str | None = None
  skip_time: str | None = None
  max_run_s: float | None = None  # overrides Limits.max_run_s (rows a target needs)


@dataclasses.dataclass
class Result:
  key: str
  time_s: float | None = None  # median
  runs: int = 0
  spread: float | None = None  # (max - min) / median of the timed runs
  temp_bytes: int | None = None
  argument_bytes: int | None = None
  output_bytes: int | None = None
  alias_bytes: int | None = None
  device_peak_bytes: int | None = None  # GPU only; see _device_peak
  device_peak_is_bound: bool = False  # True: only an upper bound (did not raise the mark)
  compile_s: float | None = None
  gflop: float | None = None  # XLA's cost analysis of the executable
  skipped: str | None = None
  predicted_s: float | None = None  # for rows skipped by time: the predicted run time
  times_s: list[float] = dataclasses.field(default_factory=list)  # every timed run

  @property
  def memory_bytes(self) -> int | None:
    """temp + argument + output bytes of the compiled executable (minus aliased bytes)."""
    if self.temp_bytes is None:
      return None
    return self.temp_bytes + self.argument_bytes + self.output_bytes - (self.alias_bytes or 0)

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["memory_bytes"] = self.memory_bytes
    return d


def pseudo_normal(seed: int, shape, dtype=jnp.float32, scale: float = 1.0):
  """Deterministic noise of mean 0 and variance ``scale**2`` (uniform, not Gaussian) from an
  integer hash of the element index: compiles in a fraction of jax.random's time."""
  size = int(np.prod(shape))
  h = jax.lax.iota(jnp.uint32, size) * jnp.uint32(0x9E3779B1) + jnp.uint32(
      (seed * 0x85EBCA77 + 0x165667B1) % 2**32
  )
  for shift, mult in ((16, 0x7FEB352D), (15, 0x846CA68B)):
    h = (h ^ (h >> shift)) * jnp.uint32(mult)
  h = h ^ (h >> 16)
  u = (h >> 8).astype(jnp.float32) * (2.0**-24)  # uniform in [0, 1)
  return ((u - 0.5) * (scale * 12**0.5)).reshape(shape).astype(dtype)


def device_memory_stats() -> dict | None:
  """The allocator's stats on GPU/TPU; None on CPU (XLA's CPU client keeps none)."""
  try:
    return jax.devices()[0].memory_stats()
  except Exception:  # a backend without the method: report no device memory, never guess
    return None


def _nbytes(tree) -> int:
  return int(sum(getattr(a, "nbytes", 0) for a in jax.tree_util.tree_leaves(tree)))


def _run(compiled, args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  return time.perf_counter() - t0


# Rows faster than this run twice per round and time the second run. Interleaving puts each
# row right after others that freed hundreds of MB; the allocator hands that memory back to
# the OS, and the next row's first run pays the page faults of re-touching it (measured on
# the 2-core box: toeplitz_matmul at N=4096 timed 133 ms right after the large rows, 40 ms
# after itself). A training loop repeats one step, so the primed time is the one that counts.
PRIMED_BELOW_S = 2.0


@dataclasses.dataclass(frozen=True)
class Limits:
  """When not to run a case (its memory is still reported from the compiled executable).

  Attributes:
    max_run_s: skip a case whose run is predicted to take longer: the time of the same row
      at the previous (shorter) length times the ratio of XLA's flop counts.
    max_memory_bytes: skip a case whose compiled temp + argument + output bytes exceed this.
    target_run_s: the ``max_run_s`` of the rows a target is read from (modes set it as the
      case's own ``Case.max_run_s``).
  """

  max_run_s: float = float("inf")
  max_memory_bytes: float = float("inf")
  target_run_s: float = float("inf")


def measure_group(
    cases: Sequence[Case],
    *,
    history: dict | None = None,
    limits: Limits = Limits(),
    min_time_s: float = 1.0,
    min_runs: int = 3,
    max_runs: int = 7,
) -> dict[str, Result]:
  """Measures ``cases`` side by side (see the module docstring); returns key -> Result.

  Each case runs ``clamp(ceil(min_time_s / warm-up time), min_runs, max_runs)`` timed runs,
  interleaved with the other cases of the group. ``history`` (family -> (gflop, seconds),
  updated here) carries each row's last time to the next length for ``limits.max_run_s``;
  a case's family is its key. Compilation runs on all cores at once (nothing is timed
  then); lowering stays on this thread.
  """
  history = {} if history is None else history
  results = {c.key: Result(c.key, skipped=c.skip) for c in cases}
  lowered = {
      c.key: jax.jit(c.fn).lower(*jax.eval_shape(c.make_inputs)) for c in cases if not c.skip
  }
  with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
    done = dict(zip(lowered, pool.map(_compile, lowered.values())))
  compiled: dict[str, Any] = {}
  for case in cases:
    if case.skip:
      continue
    res = results[case.key]
    exe, res.compile_s = done[case.key]
    _read_compiled(exe, res)
    case_limits = (
        limits if case.max_run_s is None else dataclasses.replace(limits, max_run_s=case.max_run_s)
    )
    res.skipped = case.skip_time or _over_limits(res, history.get(case.key), case_limits)
    if res.skipped:
      if case.key in history and res.gflop:
        prev_gflop, prev_s = history[case.key]
        res.predicted_s = prev_s * res.gflop / prev_gflop
        history[case.key] = (res.gflop, res.predicted_s)
      continue
    compiled[case.key] = exe

  # One jit builds every input of the group (one compile instead of one per case).
  makers = {c.key: c.make_inputs for c in cases if c.key in compiled}
  inputs = jax.block_until_ready(jax.jit(lambda: {k: m() for k, m in makers.items()})())
  runs_left: dict[str, int] = {}
  times: dict[str, list[float]] = {}
  firsts: dict[str, float] = {}
  high_water = None
  for k, exe in compiled.items():
    stats_before = device_memory_stats()
    first = firsts[k] = _run(exe, inputs[k])
    if stats_before:
      high_water = _device_peak(results[k], stats_before, _nbytes(inputs[k]), high_water)
    runs_left[k] = int(min(max(math.ceil(min_time_s / max(first, 1e-9)), min_runs), max_runs))
    times[k] = []
  while any(runs_left.values()):
    for k, exe in compiled.items():
      if runs_left[k]:
        if firsts[k] < PRIMED_BELOW_S:
          _run(exe, inputs[k])  # untimed: the timed run finds this case's own buffers warm
        times[k].append(_run(exe, inputs[k]))
        runs_left[k] -= 1
  for k, ts in times.items():
    res = results[k]
    res.time_s = float(np.median(ts))
    res.times_s = [float(t) for t in ts]
    res.runs = len(ts)
    res.spread = float((max(ts) - min(ts)) / res.time_s)
    if res.gflop:
      history[k] = (res.gflop, res.time_s)
  del inputs
  return results


def _compile(lowered):
  t0 = time.perf_counter()
  exe = lowered.compile()
  return exe, time.perf_counter() - t0


def _read_compiled(exe, res: Result) -> None:
  """Memory and flops of a compiled executable into ``res``."""
  mem = exe.memory_analysis()
  if mem is not None:
    res.temp_bytes = int(mem.temp_size_in_bytes)
    res.argument_bytes = int(mem.argument_size_in_bytes)
    res.output_bytes = int(mem.output_size_in_bytes)
    res.alias_bytes = int(mem.alias_size_in_bytes)
  cost = exe.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  if cost and cost.get("flops", 0) > 0:
    res.gflop = float(cost["flops"]) / 1e9


def _over_limits(res: Result, previous, limits: Limits) -> str | None:
  mem = res.memory_bytes
  if mem is not None and mem > limits.max_memory_bytes:
    return (
        f"skipped: needs {fmt_bytes(mem)} (compiled), over the "
        f"{fmt_bytes(int(limits.max_memory_bytes))} limit"
    )
  if previous is not None and res.gflop:
    prev_gflop, prev_s = previous
    predicted = prev_s * res.gflop / prev_gflop
    if predicted > limits.max_run_s:
      return (
          f"skipped: ~{predicted:.0f} s per run predicted (flops x the shorter length's "
          f"time), over the {limits.max_run_s:g} s limit"
      )
  return None


def _device_peak(res: Result, before: dict | None, arg_bytes: int, high_water):
  """GPU: the case's own peak from the allocator's high-water mark, which only grows.

  ``peak_bytes_in_use`` after the warm-up minus ``bytes_in_use`` before it (every live input,
  this case's included) plus this case's input bytes is the case's temp + output + argument
  peak, when the run raised the mark. When it did not, the case peaked at most there: the
  value is then an upper bound (``device_peak_is_bound``). Returns the new high-water mark.
  """
  after = device_memory_stats()
  if not before or not after or "peak_bytes_in_use" not in after:
    return high_water
  peak = int(after["peak_bytes_in_use"])
  base = int(before.get("bytes_in_use", 0))
  res.device_peak_bytes = peak - base + arg_bytes
  res.device_peak_is_bound = high_water is not None and peak <= high_water
  return peak if high_water is None else max(peak, high_water)


def fit_exponent(lengths: Sequence[float], values: Sequence[float]) -> float | None:
  """Least-squares slope of log(value) against log(length): value ~ length^slope."""
  pts = [(math.log(n), math.log(v)) for n, v in zip(lengths, values) if v and v > 0]
  if len(pts) < 2:
    return None
  x = np.array([p[0] for p in pts])
  y = np.array([p[1] for p in pts])
  return float(np.polyfit(x, y, 1)[0])


def fmt_ms(seconds: float | None) -> str:
  if seconds is None:
    return "-"
  ms = seconds * 1e3
  return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def fmt_bytes(n: int | None) -> str:
  if n is None:
    return "-"
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.3g} {unit}"
  return f"{n} B"


# ---------------------------------------------------------------------------------------------
# What a mode hands back: tables (markdown rows + raw data + plot panels) and targets
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Panel:
  """One subplot: ``series`` label -> [(x, y)] on log-log axes."""

  title: str
  xlabel: str
  ylabel: str
  series: dict[str, list[tuple[float, float]]]


@dataclasses.dataclass
class Table:
  name: str  # file stem: benchmarks/<platform>/<mode>_<name>.json / .png
  title: str
  header: list[str]
  rows: list[list[str]]
  notes: list[str]
  data: dict
  panels: list[Panel] = dataclasses.field(default_factory=list)

  def markdown(self) -> str:
    right = [
        "---:" if any(_numeric(r[i]) for r in self.rows) else "---" for i in range(len(self.header))
    ]
    lines = ["| " + " | ".join(self.header) + " |", "|" + "|".join(right) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in self.rows]
    if self.notes:
      lines += [""] + [f"- {n}" for n in self.notes]
    return "\n".join(lines)


def _numeric(cell: str) -> bool:
  return bool(cell) and (cell[0].isdigit() or cell[0] == "-" and cell[1:2].isdigit())


@dataclasses.dataclass
class Target:
  """One line of the Targets list (a performance goal), as measured.

  ``passed`` is None when this run did not measure it (``measured`` says why).
  """

  text: str
  measured: str
  passed: bool | None

  @property
  def verdict(self) -> str:
    return {True: "PASS", False: "FAIL", None: "NOT MEASURED"}[self.passed]


class Footnotes:
  """Skip reasons as footnotes: a cell reads ``skip [a]``, the note ``[a] reason``."""

  def __init__(self):
    self.marks: dict[str, str] = {}

  def time(self, res: Result | None) -> str:
    """Median ms, or the skip mark."""
    if res is None:
      return "-"
    return self.mark(res.skipped) if res.time_s is None else fmt_ms(res.time_s)

  def memory(self, res: Result | None) -> str:
    """Compiled bytes (known even for cases not run), or the skip mark."""
    if res is None:
      return "-"
    return self.mark(res.skipped) if res.memory_bytes is None else fmt_bytes(res.memory_bytes)

  def mark(self, reason: str) -> str:
    if reason not in self.marks:
      self.marks[reason] = str(len(self.marks) + 1)
    return f"skip [{self.marks[reason]}]"

  def notes(self) -> list[str]:
    return [f"[{m}] {reason}" for reason, m in self.marks.items()]
