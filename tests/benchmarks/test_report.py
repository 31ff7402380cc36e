"""The pieces the benchmarks share to write their records: the quoted command and the
headline of a table (context_parallel, million), the bytes of a compiled step's
``memory_analysis`` (memory, context_parallel, million, gpu) and gpu's tables of timed rows
(its RPE steps and softmax implementations)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import gpu, report
from benchmarks import memory as bench_memory


def test_quoted_command_and_headline():
  command = report.quoted_command("python -m benchmarks x", ["--cells=a + b", "--n=2"])
  assert command == "python -m benchmarks x '--cells=a + b' --n=2"
  line = report.headline(command, "cpu: cpu")
  assert line.startswith(f"`{command}` (") and f", cpu: cpu, jax {jax.__version__}, " in line


def test_analysis_bytes_total_is_what_the_executable_holds():
  f = jax.jit(lambda a, b: (a @ b).sum(0))
  x = jnp.ones((64, 64), jnp.float32)
  mem = f.lower(x, x).compile().memory_analysis()
  got = bench_memory.analysis_bytes(mem)
  assert list(got) == ["temp", "arguments", "outputs", "alias", "total"]
  assert got["arguments"] == 2 * 64 * 64 * 4 and got["outputs"] == 64 * 4
  assert got["total"] == got["temp"] + got["arguments"] + got["outputs"] - got["alias"]
  assert got["total"] == bench_memory.total_bytes(mem)


RUN = {"command": "c", "machine": "m", "date": "d", "load_average": "1.0"}


def test_timed_rows_tables_read_each_ratio_column():
  rows = {2048: {"CPU steps": {"ms": 12.3, "vs_cpu_steps": 1.0, "times_ms": [12.0, 12.5]}}}
  rows[1024] = {"one batch": {"ms": 6.1, "vs_cpu_steps": 0.5, "times_ms": [6.0]}}
  text = gpu.rpe_steps_markdown(RUN, rows).splitlines()
  assert text[0] == "# Kernelized RPE's FFT path: one batched transform against serial steps"
  assert text[2] == report.provenance(RUN) + "."
  assert text[-3:] == [
      "|---:|---|---:|---:|---|",
      "| 1024 | one batch | 6 | 0.50x | 6 |",  # N in order
      "| 2048 | CPU steps | 12 | 1.00x | 12, 12 |",
  ]
  assert text[-4] == "| N | row | ms | time / CPU steps | runs (ms) |"
  rows = {512: {"plain, einsum": {"ms": 7.0, "vs_jax": 1.4, "times_ms": [7.0]}}}
  text = gpu.softmax_impls_markdown(RUN, rows, impls=("jax", "einsum")).splitlines()
  assert text[-3] == "| N | row | ms | time / jax | runs (ms) |"
  assert text[-1] == "| 512 | plain, einsum | 7 | 1.40x | 7 |"
