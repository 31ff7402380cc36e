"""What checkpoint digests cost: ``python -m benchmarks checkpoint_digests [--out=DIR]``.

For a tiny model and one of LRA Text's size (4 layers x 256, MLP 1024, 4 heads, learned
absolute positions; the synthetic task, so no data is needed), one run measures side by side,
rotating the order of three ways in each repeat: orbax alone ("orbax"), digests by the
position-keyed sum for every array ("sum": format 1, as every checkpoint was digested before,
and still the method on accelerators) and digests as recorded now on this platform ("auto":
SHA-256 of the bytes of arrays held in host memory, format 2):

- save: orbax's save of the state, data position and meta as it was (``CheckpointManager``
  directly) against ``Checkpoints.save`` (digests computed, then the same save): the seconds
  the training loop is blocked and the seconds until the write is complete;
- restore: orbax's restore against ``Checkpoints.restore`` (the same restore, then every
  array, the meta and the data position checked against the digests), each of a different
  checkpoint (tensorstore caches what it read);
- the digests alone by each method, the first call (compiling the device program, for arrays
  too large to hash on the host) apart, and one training step of the model, for scale.

Steps that do not save run no digest code: the cost lands on save steps only. Targets (PASS /
FAIL), on the mid-size model and for the "auto" way: a save's digests take at most 5% of one
training step; they add at most 10% to a save's total time and at most 25% to a restore's.
Reported: the median of the repeats, after one untimed warm-up of each way.
Exit 0 when the targets pass, 1 otherwise, 2 for a bad flag (one line).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from benchmarks import report
from fastpos.train import digest as digest_lib
from fastpos.train import metrics as metrics_lib
from fastpos.train import run as run_lib
from fastpos.train import sharding as sharding_lib
from fastpos.train.checkpoint import Checkpoints, config_meta
from fastpos.train.config import base_config
from fastpos.train.steps import make_train_step, without_carry

MODELS = {
    "tiny (1 x 32)": dict(
        num_layers=1, embed_dim=32, num_heads=2, mlp_dim=32, max_length=64, batch_size=4
    ),
    "LRA Text size (4 x 256, MLP 1024)": dict(
        num_layers=4, embed_dim=256, num_heads=4, mlp_dim=1024, max_length=1024, batch_size=4
    ),
}
SAVE_GOAL, RESTORE_GOAL = 0.10, 0.25  # added fraction of a save's / a restore's time
STEP_GOAL = 0.05  # the digests of one save, as a fraction of one training step


def _config(spec: dict):
  c = base_config("synthetic")
  c.task.update(
      max_length=spec["max_length"],
      min_length=spec["max_length"] // 2,
      num_train=64,
      num_validation=8,
      num_test=8,
  )
  c.model.update(
      num_layers=spec["num_layers"],
      embed_dim=spec["embed_dim"],
      num_heads=spec["num_heads"],
      mlp_dim=spec["mlp_dim"],
      positional="absolute",
  )
  c.batch_size, c.keep_checkpoints, c.data.num_threads = spec["batch_size"], 1000, 1
  return c


def _median(xs) -> float:
  return float(statistics.median(xs))


def _step_seconds(run, batch, repeats: int) -> float:
  step = jax.jit(
      without_carry(make_train_step(run.model, run.tx, run.info.kind, 1)), donate_argnums=0
  )
  state, _ = run.init_state()
  rng = jax.random.key_data(jax.random.key(0))
  state, m = step(state, batch, rng)  # compiles
  jax.block_until_ready(m)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    state, m = step(state, batch, rng)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - start)
  return _median(times)


def measure(spec: dict, repeats: int, tmp: Path) -> dict:
  """Seconds of each operation (medians) for the model of ``spec``."""
  run = run_lib.build_run(_config(spec), tmp / "run")
  src = run.task.source("train")
  it = run.feed.train(src, 0)
  batch = sharding_lib.global_batch(next(it), run.shardings.batch)
  state, _ = run.init_state()
  leaves = jax.tree.leaves(state)
  out = {
      "parameters": run.num_params,
      "state_arrays": len(leaves),
      "state_bytes": int(sum(x.nbytes for x in leaves)),
      "arrays_on_device": sum(int(np.prod(x.shape)) > digest_lib.HOST_MAX_ELEMENTS for x in leaves),
  }
  for method in digest_lib.METHODS:
    start = time.perf_counter()
    digest_lib.array_digests(state, method)
    out[f"digests_first_call_{method}_s"] = time.perf_counter() - start
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      rec = digest_lib.array_digests(state, method)
      times.append(time.perf_counter() - start)
    out[f"digests_{method}_s"] = _median(times)
    start = time.perf_counter()
    digest_lib.check_arrays(rec, state)
    out[f"check_{method}_s"] = time.perf_counter() - start
  out["train_step_s"] = _step_seconds(run, batch, repeats)

  ckpts = Checkpoints(tmp / "run", run.cfg)
  ckpts.open_for_writing()
  cost = {f"{k}_{way}": [] for k in ("save_blocking", "save_total", "restore") for way in WAYS}
  try:
    for r in range(-1, repeats):  # r = -1: untimed warm-up of every way
      for way in _order(r):
        step = len(WAYS) * (r + 1) + WAYS.index(way) + 1
        meta = {
            "rng": [0, step],
            "config": config_meta(run.cfg, run.info),
            "step": step,
            "data": None,
            "log_window": None,
        }
        start = time.perf_counter()
        if way == "orbax":
          ckpts.latest.save(
              step,
              args=ocp.args.Composite(
                  state=ocp.args.StandardSave(state),
                  data=grain.checkpoint.CheckpointSave(it),
                  meta=ocp.args.JsonSave(meta),
              ),
              force=True,
          )
        else:
          with _method(way):
            ckpts.save(step, state, it, meta)
        blocking = time.perf_counter() - start
        ckpts.wait()
        if r >= 0:
          cost[f"save_blocking_{way}"].append(blocking)
          cost[f"save_total_{way}"].append(time.perf_counter() - start)
    for r in range(-1, repeats):
      for way in _order(r):
        step = len(WAYS) * (r + 1) + WAYS.index(way) + 1
        start = time.perf_counter()
        if way == "orbax":  # as restores read before: the meta, then the state
          ckpts.latest.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
          restored = ckpts.latest.restore(
              step, args=ocp.args.Composite(state=ocp.args.StandardRestore(run.abstract))
          )["state"]
          jax.block_until_ready(restored)
        else:  # each entry is checked by the method it names: the checkpoint's way
          ckpts.restore(run.abstract, step=step)
        if r >= 0:
          cost[f"restore_{way}"].append(time.perf_counter() - start)
  finally:
    ckpts.close()
  out.update({f"{k}_s": _median(v) for k, v in cost.items()})
  for way in WAYS[1:]:
    out[f"save_added_{way}"] = out[f"save_total_{way}_s"] / out["save_total_orbax_s"] - 1
    out[f"restore_added_{way}"] = out[f"restore_{way}_s"] / out["restore_orbax_s"] - 1
  return out


WAYS = ("orbax", "sum", "auto")


def _order(r: int) -> tuple[str, ...]:
  """The ways in repeat ``r``'s order: rotated, so each runs first, second and last alike."""
  k = r % len(WAYS)
  return WAYS[k:] + WAYS[:k]


@contextlib.contextmanager
def _method(way: str):
  """While entered, checkpoints record digests as ``way`` says ("sum": the sum everywhere,
  as on an accelerator; "auto": as this platform records them)."""
  platforms = digest_lib.BYTE_HASH_PLATFORMS
  if way == "sum":
    digest_lib.BYTE_HASH_PLATFORMS = frozenset()
  try:
    yield
  finally:
    digest_lib.BYTE_HASH_PLATFORMS = platforms


HEADER = """# Checkpoint digests: what they cost on save and restore

Every checkpoint records a digest of each array of the train state, of the data-iterator
state and of its metadata, and every restore checks them (``fastpos.train.digest``). Below:
orbax alone against orbax plus digests by the position-keyed sum ("sum", format 1: every array
before, and the method on accelerators) and as recorded now ("auto", format 2: SHA-256 of the
bytes of arrays in host memory), side by side in one run (medians; one untimed warm-up;
``benchmarks/checkpoint_digests.py`` says what each column is). Steps that do not save run
no digest code. Timings on a shared 2-core CPU box are noisy: read the load average. A
negative added cost means the difference is below the run-to-run noise of orbax itself; the
"digests alone" column is the steadier measure of what verification adds."""


def _ms(r: dict, key: str) -> str:
  return " / ".join(f"{r[f'{key}_{way}_s'] * 1e3:.0f}" for way in WAYS)


def _added(r: dict, key: str) -> str:
  return ", ".join(f"{way} {100 * r[f'{key}_added_{way}']:+.0f}%" for way in WAYS[1:])


def _table(results: dict, command: str) -> str:
  lines = [
      HEADER,
      "",
      f"`{command}` ({platform.node() or 'host'}, {jax.devices()[0].platform}, jax "
      f"{jax.__version__}, {time.strftime('%Y-%m-%d')}, load average "
      f"{os.getloadavg()[0]:.1f})",
      "",
      "| model | state | save blocks (ms): orbax / sum / auto | save total (ms): orbax / sum / "
      "auto | restore (ms): orbax / + verify sum / + verify auto | digests alone (ms): sum / "
      "auto (first call, s) | train step |",
      "|---|---|---|---|---|---|---|",
  ]
  for name, r in results.items():
    lines.append(
        f"| {name} | {r['state_bytes'] / 2**20:.1f} MiB, {r['state_arrays']} arrays "
        f"({r['arrays_on_device']} on device for the sum) "
        f"| {_ms(r, 'save_blocking')} "
        f"| {_ms(r, 'save_total')} ({_added(r, 'save')}) "
        f"| {_ms(r, 'restore')} ({_added(r, 'restore')}) "
        f"| {r['digests_sum_s'] * 1e3:.1f} / {r['digests_auto_s'] * 1e3:.1f} "
        f"({r['digests_first_call_sum_s']:.2f} / {r['digests_first_call_auto_s']:.2f}) "
        f"| {r['train_step_s'] * 1e3:.0f} ms |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks checkpoint_digests")
  parser.add_argument("--out", default="", help="folder for checkpoint_digests.md / .json")
  parser.add_argument("--repeats", type=int, default=5, help="repeats of each measurement")
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error(f"--repeats={args.repeats}: must be >= 1")
  command = "python -m benchmarks checkpoint_digests" + (f" --out={args.out}" if args.out else "")
  results = {}
  with metrics_lib.quiet_library_logs(), tempfile.TemporaryDirectory() as tmp:
    for i, (name, spec) in enumerate(MODELS.items()):
      results[name] = measure(spec, args.repeats, Path(tmp) / str(i))
      print(f"{name}: done", file=sys.stderr, flush=True)
  mid = results[list(MODELS)[-1]]
  targets = {
      f"step: a save's digests take <= {STEP_GOAL:.0%} of a training step (mid-size, auto)": mid[
          "digests_auto_s"
      ]
      <= STEP_GOAL * mid["train_step_s"],
      f"save: digests add <= {SAVE_GOAL:.0%} to a save (mid-size, auto)": mid["save_added_auto"]
      <= SAVE_GOAL,
      f"restore: verification adds <= {RESTORE_GOAL:.0%} to a restore (mid-size, auto)": mid[
          "restore_added_auto"
      ]
      <= RESTORE_GOAL,
  }
  table = (
      _table(results, command)
      + "\n\n"
      + "\n".join(f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in targets.items())
  )
  print(table)
  report.write(
      args.out,
      "checkpoint_digests",
      table,
      {
          "results": results,
          "targets": targets,
          "repeats": args.repeats,
          "models": MODELS,
          "jax": jax.__version__,
          "platform": jax.devices()[0].platform,
          "load_average": os.getloadavg()[0],
          "date": time.strftime("%Y-%m-%d"),
      },
  )
  return 0 if all(targets.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
