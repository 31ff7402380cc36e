"""The main job's real tokens/s padded, length-bucketed and packed: ``python -m
benchmarks.packing``.

One run builds the main job (``configs/listops_generated.py``, batch 32, task.max_length 100) in
its cell that packs, softmax with learned absolute positions (``kernel=softmax,pos=none``; the
default SIKF + FastRPB cell cannot pack, ``fastpos.ops.segments``), three ways: padded to 100,
bucketed (``config.data.bucket_lengths`` 32 / 48 / 64) and packed (``config.data.pack``, up to
``data.pack_segments`` examples per row), and measures side by side:

- token slots: the real tokens over the token slots of the first ``--count_steps`` training
  batches of each stream (the main job's 600 steps by default) and of the validation batches;
- the train step alone (the trainer's ``make_train_step``, jitted, donated state) on the first
  ``--steps`` batches of each stream, alternating the three in ``--rounds`` rounds after
  compiling every batch shape: real tokens/s is the median over rounds;
- the whole job (``train_and_evaluate``, ``--job_steps`` steps with the job's evaluations and
  checkpoints, one after another in this process): the real training tokens over the wall
  time (compiles, evaluations and saves included), and the trainer's own mean tokens/s.

Targets (PASS / FAIL): packed token slots filled >= 0.9; packed real tokens/s >= 1.5x padded,
for the step alone and for the whole job. Writes ``padding_packed.md`` / ``.json`` to ``--out``
when given. Exit 0 when every target passes, 1 otherwise, 2 for a bad flag (one line).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from benchmarks import padding, report
from fastpos.train import data as data_lib
from fastpos.train import run as run_lib
from fastpos.train.steps import make_train_step, without_carry
from fastpos.train.trainer import train_and_evaluate

CELL = "kernel=softmax,pos=none"
VARIANTS = ("padded", "bucketed", "packed")
SLOT_GOAL = 0.9  # real tokens / token slots, packed
SPEED_GOAL = 1.5  # real tokens/s packed over padded


def configs(window: int, segments: int) -> dict:
  from configs import listops_generated  # the repository root is on the path (python -m)

  out = {
      "padded": listops_generated.get_config(CELL),
      "bucketed": listops_generated.get_config(CELL + ",bucket"),
      "packed": listops_generated.get_config(CELL),
  }
  out["packed"].data.update(pack=True, pack_segments=segments)
  for name in ("bucketed", "packed"):
    out[name].data.bucket_window = window
  return out


def _real(batch) -> int:
  """Real tokens of a batch: mask entries of weighted rows (packed: of weighted segments)."""
  w = batch["weight"]
  if w.ndim == 2:
    ids = batch["segment_ids"]
    per = np.take_along_axis(w, np.clip(ids - 1, 0, None), axis=1)
    return int((batch["mask"] & (ids > 0) & (per > 0)).sum())
  return int((batch["mask"] & (w[:, None] > 0)).sum())


def _slots(batches) -> tuple[int, int]:
  return sum(_real(b) for b in batches), sum(int(b["mask"].size) for b in batches)


def _take(it, n: int) -> list[dict]:
  return [next(it) for _ in range(n)]


def _streams(runs, args, rec) -> dict:
  src = runs["padded"].task.source("train")
  val = runs["padded"].task.source("validation")
  for name, run in runs.items():
    count = _take(data_lib.train_iterator(src, run.cfg), args.count_steps)
    real, slots = _slots(count)
    v_real, v_slots = _slots(list(data_lib.eval_iterator(val, run.cfg)))
    rec["variants"][name] = {
        "train_real_tokens": real,
        "train_slots": slots,
        "train_fraction": real / slots,
        "eval_fraction": v_real / v_slots,
        "examples_per_step": sum(float(b["weight"].sum()) for b in count) / len(count),
        "widths": sorted({b["inputs"].shape[1] for b in count}),
    }
  return {name: _take(data_lib.train_iterator(src, r.cfg), args.steps) for name, r in runs.items()}


def _step_alone(runs, batches, args, rec) -> None:
  fns = {
      name: jax.jit(
          without_carry(make_train_step(run.model, run.tx, run.info.kind, 1)), donate_argnums=0
      )
      for name, run in runs.items()
  }
  states = {name: run.init_state()[0] for name, run in runs.items()}
  rng = runs["padded"].train_rng
  compile_s, times = padding.time_steps(fns, states, batches, rng, args.rounds)
  for name in batches:
    rec["variants"][name]["compile_s"] = compile_s[name]
  for name, bs in batches.items():
    v, real = rec["variants"][name], sum(_real(b) for b in bs)
    v["step_real_tokens_per_s"] = statistics.median(real / t for t in times[name])
    v["step_ms"] = 1e3 * statistics.median(times[name]) / len(bs)


def _whole_job(cfgs, args, rec) -> None:
  for name, cfg in cfgs.items():
    cfg = cfg.copy_and_resolve_references()
    cfg.num_train_steps = args.job_steps
    src = run_lib.build_run(cfg, "/tmp/unused").task.source("train")
    real = sum(_real(b) for b in _take(data_lib.train_iterator(src, cfg), args.job_steps))
    with tempfile.TemporaryDirectory() as workdir:
      start = time.perf_counter()
      out = train_and_evaluate(cfg, workdir)
      wall = time.perf_counter() - start
    v = rec["variants"][name]
    v.update(
        job_steps=args.job_steps,
        job_real_tokens=real,
        job_wall_s=wall,
        job_real_tokens_per_s=real / wall,
        job_trainer_tokens_per_s=out["tokens_per_second"],
        job_validation_accuracy=out["validation"]["accuracy"],
    )


def _verdicts(rec: dict) -> list[tuple[str, bool]]:
  v = rec["variants"]
  step = v["packed"]["step_real_tokens_per_s"] / v["padded"]["step_real_tokens_per_s"]
  out = [
      (
          f"token slots filled, packed: {v['packed']['train_fraction']:.3f} >= {SLOT_GOAL}",
          v["packed"]["train_fraction"] >= SLOT_GOAL,
      ),
      (f"train step real tokens/s, packed {step:.2f}x padded >= {SPEED_GOAL}x", step >= SPEED_GOAL),
  ]
  if "job_real_tokens_per_s" in v["packed"]:
    job = v["packed"]["job_real_tokens_per_s"] / v["padded"]["job_real_tokens_per_s"]
    out.append(
        (f"whole job real tokens/s, packed {job:.2f}x padded >= {SPEED_GOAL}x", job >= SPEED_GOAL)
    )
  return out


def _table(rec: dict, verdicts) -> str:
  v = [rec["variants"][n] for n in VARIANTS]
  pad = v[0]

  def row(label, fmt, key, ratio=False):
    cells = [fmt.format(x[key]) if key in x else "-" for x in v]
    if ratio and key in pad:
      cells = [f"{c} ({x[key] / pad[key]:.2f}x)" for c, x in zip(cells, v)]
    return f"| {label} | " + " | ".join(cells) + " |"

  lines = [
      "| measure | padded to 100 | bucketed 32/48/64/100 | packed (<= %d per row) |"
      % rec["pack_segments"],
      "|---|---|---|---|",
      row(
          f"token slots filled, training (first {rec['count_steps']} batches)",
          "{:.3f}",
          "train_fraction",
      ),
      row("token slots filled, validation", "{:.3f}", "eval_fraction"),
      row("examples per step", "{:.1f}", "examples_per_step"),
      row(
          "real tokens/s, train step alone (median of rounds)",
          "{:,.0f}",
          "step_real_tokens_per_s",
          True,
      ),
      row("ms per step (median)", "{:.1f}", "step_ms"),
      "| compile s per batch width | "
      + " | ".join(", ".join(f"{w}: {s:.1f}" for w, s in x["compile_s"].items()) for x in v)
      + " |",
  ]
  if "job_wall_s" in pad:
    lines += [
        row(
            f"whole job ({rec['job_steps']} steps): real tokens / wall s",
            "{:,.0f}",
            "job_real_tokens_per_s",
            True,
        ),
        row("whole job: the trainer's mean tokens/s", "{:,.0f}", "job_trainer_tokens_per_s"),
        row("whole job: wall s", "{:.0f}", "job_wall_s"),
        row("whole job: last validation accuracy", "{:.3f}", "job_validation_accuracy"),
    ]
  lines.append("")
  lines += [f"- {'PASS' if ok else 'FAIL'}: {what}" for what, ok in verdicts]
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--window", type=int, default=16)
  p.add_argument("--segments", type=int, default=8)
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--count_steps", type=int, default=600)
  p.add_argument("--job_steps", type=int, default=600, help="0: skip the whole-job runs")
  p.add_argument("--out", default="")
  try:
    args = p.parse_args(argv)
  except SystemExit as e:
    return 2 if e.code else 0
  if min(args.steps, args.rounds, args.count_steps, args.window, args.segments) < 1:
    print(
        "--steps, --rounds, --count_steps, --window and --segments must be >= 1.", file=sys.stderr
    )
    return 2
  cfgs = configs(args.window, args.segments)
  runs = {name: run_lib.build_run(c, "/tmp/unused") for name, c in cfgs.items()}
  rec = {
      "cell": CELL,
      "window": args.window,
      "pack_segments": args.segments,
      "batch_size": cfgs["padded"].batch_size,
      "count_steps": args.count_steps,
      "job_steps": args.job_steps,
      "variants": {},
  }
  batches = _streams(runs, args, rec)
  _step_alone(runs, batches, args, rec)
  if args.job_steps:
    _whole_job(cfgs, args, rec)
  verdicts = _verdicts(rec)
  rec.update(
      command=report.command("packing", argv),
      load_average=os.getloadavg()[0],
      machine=platform.node(),
      jax=jax.__version__,
      platform=jax.default_backend(),
      date=time.strftime("%Y-%m-%d"),
      verdicts=[{"what": w, "pass": ok} for w, ok in verdicts],
  )
  table = (
      f"`{rec['command']}` ({jax.default_backend()}, jax {jax.__version__}, {rec['date']}, "
      f"load average {rec['load_average']:.1f})\n\n" + _table(rec, verdicts)
  )
  print(table)
  report.write(args.out, "padding_packed", table, rec)
  return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
