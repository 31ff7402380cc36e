"""Memory per device of a train step with the sequence split over devices (``mesh.seq``):
``python -m benchmarks context_parallel``.

The trainer's train step (AdamW, dropout, the jit shardings of ``fastpos.train``) of an LRA
Text-sized classifier (4 layers, width 256, 4 heads, MLP 1024, mean pooling, batch 1) is
compiled for ``mesh.seq`` = 1, 2, 4 (P devices, data axis 1) at each length, and the
compiled executable's ``memory_analysis()`` read: it is per device. Reported: temporary
bytes and the total (arguments + outputs + temporaries - donated aliases), and the ratio to
seq = 1 (a split sequence should divide the activation memory by about P; parameters and
optimizer state stay replicated). Then the longest N (a multiple of ``--step``) whose train
step fits ``--budget`` GiB per device, on 1 device and on P = max(--seqs) devices.

On a CPU host the devices are simulated (``--xla_force_host_platform_device_count``, set
here before JAX starts); nothing runs, only compiles. Exit 0 when the largest split uses at
most ``--target`` of the unsplit memory at every length (default 0.5 for P = 4), 1 otherwise,
2 for a bad flag (one line).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import memory as bench_memory
from benchmarks import report
from fastpos.models import TaskInfo, build_model
from fastpos.train import sharding as sharding_lib
from fastpos.train.config import base_config
from fastpos.train.state import TrainState, make_optimizer
from fastpos.train.steps import make_train_step, without_carry

CELLS = {
    "sikf + fastrpb": ("sikf", "fastrpb"),
    "nprf + kernelized_rpe": ("nprf", "kernelized_rpe"),
    "causal LM elu1 + permuteformer": ("elu1", "permuteformer"),
}


def text_config(kernel: str, scheme: str, seq: int, layers: int = 4):
  """The LRA Text-sized classifier (width 256, 4 heads, MLP 1024, mean pooling, batch 1) with
  ``kernel`` and ``scheme``, ``layers`` deep, its sequence split over ``seq`` devices."""
  c = base_config("synthetic")
  c.model.update(
      kernel=kernel,
      positional=scheme,
      num_layers=layers,
      embed_dim=256,
      num_heads=4,
      mlp_dim=1024,
      dropout_rate=0.1,
      pooling="mean",
  )
  c.model.kernel_options.num_features = 32
  c.batch_size = 1
  c.mesh.seq = seq
  return c


def build_step(cfg, task: TaskInfo, n: int):
  """(jitted step, abstract state, abstract batch, abstract rng, init fn) of the trainer's
  train step for ``cfg`` on ``task`` at batch 1 x ``n`` tokens, the sequence split over
  ``cfg.mesh.seq`` devices; the state sharded by ``cfg.mesh.rules`` and the position rules."""
  seq = cfg.mesh.seq
  model = build_model(cfg.model, task)
  mesh = sharding_lib.make_mesh(cfg, jax.devices()[:seq])
  sharding_lib.check_seq_split(mesh, n, model)
  tx = make_optimizer(cfg)

  def init(rng):
    variables = model.init(
        {"params": rng, "dropout": rng, "features": rng},
        {"inputs": jnp.ones((1, n), jnp.int32)},
        train=False,
    )
    params = variables.pop("params")
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        collections=dict(variables),
    )

  abstract = jax.eval_shape(init, jax.random.key(0))
  state_sharding = sharding_lib.tree_shardings(abstract, mesh, cfg.mesh.rules)
  state = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, state_sharding
  )
  tokens = NamedSharding(
      mesh, P(sharding_lib.DATA, sharding_lib.SEQ) if seq > 1 else P(sharding_lib.DATA)
  )
  rows = sharding_lib.batch_sharding(mesh)
  batch = {
      "inputs": jax.ShapeDtypeStruct((1, n), jnp.int32, sharding=tokens),
      "mask": jax.ShapeDtypeStruct((1, n), jnp.bool_, sharding=tokens),
      "weight": jax.ShapeDtypeStruct((1,), jnp.float32, sharding=rows),
  }
  if task.kind == "lm":
    batch["targets"] = jax.ShapeDtypeStruct((1, n), jnp.int32, sharding=tokens)
  else:
    batch["targets"] = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=rows)
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding_lib.replicated(mesh))
  step = jax.jit(
      sharding_lib.in_seq_mesh(without_carry(make_train_step(model, tx, task.kind)), mesh),
      in_shardings=(
          state_sharding,
          sharding_lib.batch_in_sharding(mesh),
          sharding_lib.replicated(mesh),
      ),
      out_shardings=(state_sharding, sharding_lib.replicated(mesh)),
      donate_argnums=0,
  )
  init_fn = jax.jit(init, out_shardings=state_sharding)
  return step, state, batch, rng, init_fn


def step_memory(cell: str, n: int, seq: int) -> dict:
  """Per-device bytes of the compiled train step of ``cell`` at length ``n`` over ``seq``
  devices (the sequence split over all of them)."""
  kernel, scheme = CELLS[cell]
  lm = cell.startswith("causal")
  task = TaskInfo("lm" if lm else "classify", 257, 0 if lm else 2, n)
  step, state, batch, rng, _ = build_step(text_config(kernel, scheme, seq), task, n)
  start = time.perf_counter()
  m = bench_memory.analysis_bytes(step.lower(state, batch, rng).compile().memory_analysis())
  return {
      "temp": m["temp"],
      "total": m["total"],
      "arguments": m["arguments"],
      "compile_s": time.perf_counter() - start,
  }


def longest_fitting(cell: str, seq: int, budget: float, step: int, limit: int) -> tuple:
  """(longest N, a multiple of ``step``, whose step fits ``budget`` bytes per device; the
  lengths tried with their totals): doubling, then bisection."""
  tried, lo, hi, n = {}, 0, None, step
  while n <= limit:
    tried[n] = step_memory(cell, n, seq)["total"]
    if tried[n] > budget:
      hi = n
      break
    lo, n = n, 2 * n
  while hi is not None and hi - lo > step:
    mid = (lo + hi) // 2 // step * step
    tried[mid] = step_memory(cell, mid, seq)["total"]
    lo, hi = (mid, hi) if tried[mid] <= budget else (lo, mid)
  return lo, tried


def simulated_devices(count: int) -> int:
  """Asks XLA for ``count`` host devices (simulated on a CPU host; unless XLA_FLAGS sets a
  count already), before JAX starts its backends; returns the number of devices JAX sees."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"
  return jax.device_count()


def _mib(nbytes: int) -> str:
  return f"{nbytes / 2 ** 20:,.0f} MiB"


def _checked_args(args) -> tuple[list[int], list[int], list[str]]:
  """(lengths, seqs, cells) from the flags; ValueError naming the bad one."""
  lengths = report.increasing_ints(args.lengths, "--lengths")
  seqs = report.increasing_ints(args.seqs, "--seqs")
  cells = [c.strip() for c in args.cells.split(",") if c.strip()]
  for c in cells:
    if c not in CELLS:
      raise ValueError(f"--cells: unknown cell {c!r}; valid choices: {', '.join(CELLS)}.")
  if seqs[0] != 1:
    raise ValueError(f"--seqs={args.seqs!r} must start with 1 (the unsplit reference).")
  for n in lengths:
    if n % seqs[-1]:
      raise ValueError(f"--lengths: {n} is not divisible by mesh.seq={seqs[-1]}.")
  if args.step < 1 or args.step % seqs[-1]:
    raise ValueError(f"--step={args.step} must be a positive multiple of {seqs[-1]}.")
  return lengths, seqs, cells


def _measure(cells, lengths, seqs) -> dict:
  """{cell: {"N/seq": step_memory(...)}}, printed as it goes."""
  results = {c: {} for c in cells}
  for cell in cells:
    for n in lengths:
      for seq in seqs:
        r = step_memory(cell, n, seq)
        results[cell][f"{n}/{seq}"] = r
        print(
            f"{cell} N={n} seq={seq}: temp {_mib(r['temp'])}, total {_mib(r['total'])} per "
            f"device (compiled in {r['compile_s']:.0f} s)",
            flush=True,
        )
  return results


def _longest(cells, seqs, args) -> dict:
  """{"cell/seq": {"longest", "tried"}}: the longest N within --budget GiB per device."""
  fits = {}
  for cell in cells:
    for seq in sorted({1, seqs[-1]}):
      longest, tried = longest_fitting(cell, seq, args.budget * 2**30, args.step, args.limit)
      fits[f"{cell}/{seq}"] = {"longest": longest, "tried": tried}
      print(
          f"{cell} seq={seq}: longest N within {args.budget:g} GiB per device: {longest}",
          flush=True,
      )
  return fits


def main(argv=None) -> int:
  prog = "python -m benchmarks context_parallel"
  parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
  parser.add_argument("--lengths", default="16384,65536")
  parser.add_argument("--seqs", default="1,2,4", help="mesh.seq values (devices)")
  parser.add_argument("--cells", default=",".join(CELLS), help=", ".join(CELLS))
  parser.add_argument("--budget", type=float, default=2.0, help="GiB per device; 0 skips")
  parser.add_argument("--step", type=int, default=4096, help="granularity of the longest N")
  parser.add_argument("--limit", type=int, default=2**20, help="longest N tried")
  parser.add_argument(
      "--target",
      type=float,
      default=0.5,
      help="largest split / unsplit memory must stay below this",
  )
  parser.add_argument("--out", default="", help="folder for context_parallel.md / .json")
  args = parser.parse_args(argv)
  try:
    lengths, seqs, cells = _checked_args(args)
  except ValueError as e:
    print(f"{prog}: {e}", file=sys.stderr)
    return 2
  if simulated_devices(seqs[-1]) < seqs[-1]:
    print(
        f"{prog}: --seqs needs {seqs[-1]} devices; {jax.device_count()} visible.", file=sys.stderr
    )
    return 2

  results = _measure(cells, lengths, seqs)
  fits = _longest(cells, seqs, args) if args.budget > 0 else {}

  lines = [
      report.headline(report.quoted_command(prog, argv), jax.devices()[0].platform),
      "",
      "| cell | N | "
      + " | ".join(f"seq={s}: temp / total" for s in seqs)
      + f" | total seq={seqs[-1]} / seq=1 |",
      "|---|---|" + "---|" * (len(seqs) + 1),
  ]
  ok = True
  for cell in cells:
    for n in lengths:
      row = [results[cell][f"{n}/{s}"] for s in seqs]
      ratio = row[-1]["total"] / row[0]["total"]
      ok = ok and ratio <= args.target
      lines.append(
          f"| {cell} | {n} | "
          + " | ".join(f"{_mib(r['temp'])} / {_mib(r['total'])}" for r in row)
          + f" | {ratio:.2f} |"
      )
  if fits:
    lines += [
        "",
        f"Longest N (multiple of {args.step}) whose train step fits "
        f"{args.budget:g} GiB per device:",
        "",
        "| cell | 1 device | " + f"{seqs[-1]} devices (mesh.seq={seqs[-1]}) |",
        "|---|---|---|",
    ]
    for cell in cells:
      lines.append(
          f"| {cell} | {fits[f'{cell}/1']['longest']} | "
          f"{fits[f'{cell}/{seqs[-1]}']['longest']} |"
      )
  lines += [
      "",
      f"- {'PASS' if ok else 'FAIL'}: total memory with mesh.seq={seqs[-1]} at most "
      f"{args.target:g} x the unsplit step's at every length",
  ]
  table = "\n".join(lines)
  print(table)
  report.write(
      args.out, "context_parallel", table, {"memory": results, "fits": fits, "args": vars(args)}
  )
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
