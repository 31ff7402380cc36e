"""The main job's real tokens/s with and without length bucketing: ``python -m
benchmarks.padding``.

One run builds the README's main job (``configs/listops_generated.py``: SIKF + absolute +
FastRPB, batch 32, task.max_length 100) twice, as it is and with ``config.data.bucket_lengths``,
and measures side by side:

- token slots: the real tokens against the token slots of the first ``--count_steps`` training
  batches of each data stream (the main job's 600 steps by default) and of the validation
  batches;
- speed: the train step (the trainer's ``make_train_step``, jitted with a donated state) on
  the first ``--steps`` batches of each stream, alternating the two in ``--rounds`` rounds
  after compiling every batch shape (compile times reported apart); real tokens/s is the
  median over rounds of the real tokens over the seconds;
- the main job's estimated wall time: its compiles plus ``num_train_steps`` steps at the
  measured mean step time.

Targets (PASS / FAIL): real tokens over token slots >= 0.75 with bucketing; real tokens/s with
bucketing >= 1.5x without. Writes ``padding.md`` and ``padding.json`` to ``--out`` when given.

``--part=lm`` measures packing instead (``lm_packing``): the LM main job
(``configs/text_lm.py``, the Vim user manual at byte level, 4 x 128, context 64, batch 12)
with a linear kernel (``--lm_config``, default ``kernel=elu1``), on variable-length examples:
the manual's lines (each with its newline; longer lines cut into pieces of 65 bytes), one per
row (padded) against ``config.data.pack`` (several per row, the state reset per segment),
the same train step side by side (``padding_lm.md`` / ``.json``). Target: packed real tokens/s
>= 1.5x padded.
Exit 0 when every target passes, 1 otherwise, 2 for a bad flag (one line).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report
from fastpos.positional import compatibility
from fastpos.train import data as data_lib
from fastpos.train import run as run_lib
from fastpos.train.bucketing import bucket_lengths
from fastpos.train.steps import make_train_step, without_carry

SLOT_GOAL = 0.75  # real tokens / token slots with bucketing
SPEED_GOAL = 1.5  # real tokens/s with bucketing over without


def _configs(buckets: tuple[int, ...], window: int):
  from configs import listops_generated  # the repository root is on the path (python -m)

  before = listops_generated.get_config()
  after = listops_generated.get_config("bucket")
  if buckets:
    after.data.bucket_lengths = buckets
  after.data.bucket_window = window
  return before, after


def cell_table() -> tuple[str, list[dict]]:
  """Which (kernel, scheme, causal) cells pack, and why the others do not (the code's own
  decision, the plan: ``fastpos.positional.compatibility.refusal``)."""
  from configs import common
  from fastpos import positional

  rows, lines = [], [
      "| kernel | scheme | causal | packing (lm: causal; classify: bidirectional) | bucketing "
      "(classify, retrieval) | why it does not pack |",
      "|---|---|---|---|---|---|",
  ]
  schemes = [s for s in positional.SCHEMES if s != "transformer_xl"]
  for kernel in common.KERNELS:
    for scheme in schemes:
      for causal in (False, True):
        packed = compatibility.Setting(causal=causal, packed=True)
        why = compatibility.refusal(kernel, [scheme], packed)
        rows.append(
            {
                "kernel": kernel,
                "scheme": scheme,
                "causal": causal,
                "packs": why is None,
                "buckets": not causal,
                "why_not": why,
            }
        )
        packs = "packs" if causal else "packs (classify)"
        lines.append(
            f"| {kernel} | {scheme} | {'yes' if causal else 'no'} | "
            f"{packs if why is None else 'refuses'} | "
            f"{'buckets' if not causal else '-'} | {why or ''} |"
        )
  return "\n".join(lines), rows


def _line_source(stream, row_length: int, newline: int):
  """The token stream's lines (each ending in ``newline``; longer ones cut into pieces of
  ``row_length + 1`` tokens) as next-token examples ``[lines, row_length]``: inputs, targets,
  mask."""
  from fastpos.tasks.base import ArraySource

  ends = np.flatnonzero(np.asarray(stream) == newline) + 1
  pieces = []
  for line in np.split(np.asarray(stream, np.int32), ends):
    pieces += [line[i : i + row_length + 1] for i in range(0, len(line), row_length + 1)]
  pieces = [p for p in pieces if len(p) >= 2]
  inputs = np.zeros((len(pieces), row_length), np.int32)
  targets = np.zeros_like(inputs)
  for i, p in enumerate(pieces):
    inputs[i, : len(p) - 1], targets[i, : len(p) - 1] = p[:-1], p[1:]
  return ArraySource({"inputs": inputs, "targets": targets, "mask": inputs != 0})


def _real(batch) -> int:
  weight = batch.get("weight")
  mask = batch["mask"] if weight is None else batch["mask"] * (weight[:, None] > 0)
  return int(mask.sum())


def _measure_lm(args) -> dict:
  """Packed against padded rows of the LM main job with a linear kernel (module docstring)."""
  from configs import text_lm
  from fastpos.tasks import text as byte_text

  padded = text_lm.get_config(args.lm_config)
  packed = text_lm.get_config(args.lm_config)
  packed.data.pack, packed.data.bucket_window = True, args.window
  runs = {"padded": run_lib.build_run(padded, "/tmp/unused")}
  runs["packed"] = run_lib.build_run(packed, "/tmp/unused")
  run = runs["padded"]
  newline = int(byte_text.encode(b"\n")[0])
  src = _line_source(run.task.token_stream("train"), run.info.max_length, newline)
  att = run.model.attention
  rec = {
      "config": f"configs/text_lm.py:{args.lm_config}",
      "kernel": att.kernel.name,
      "schemes": [p.name for p in att.positional],
      "examples": len(src),
      "mean_example_tokens": float(src.arrays["mask"].sum(1).mean()),
      "row_length": run.info.max_length,
      "batch_size": padded.batch_size,
      "variants": {},
  }
  fns = {
      name: jax.jit(without_carry(make_train_step(r.model, r.tx, "lm", 1)), donate_argnums=0)
      for name, r in runs.items()
  }
  states = {name: r.init_state()[0] for name, r in runs.items()}
  batches = {
      name: _take(data_lib.train_iterator(src, r.cfg), args.steps) for name, r in runs.items()
  }
  compiles, times = time_steps(fns, states, batches, run.train_rng, args.rounds)
  for name, bs in batches.items():
    real = sum(_real(b) for b in bs)
    rows = sum(int(b.get("weight", np.ones(len(b["inputs"]))).sum()) for b in bs)
    rec["variants"][name] = {
        "timed_real_tokens": real,
        "slots_filled": real / (rows * bs[0]["inputs"].shape[1]),
        "examples_per_row": float(
            np.mean([b["segment_ids"].max(1).mean() for b in bs]) if name == "packed" else 1.0
        ),
        "compile_s": compiles[name],
        "seconds_per_round": times[name],
        "real_tokens_per_s": statistics.median(real / t for t in times[name]),
        "step_ms": 1e3 * statistics.median(times[name]) / len(bs),
    }
  return rec


def _lm_table(rec: dict, verdicts: list[tuple[str, bool]]) -> str:
  a, b = rec["variants"]["padded"], rec["variants"]["packed"]
  rows = [
      (
          "token slots filled (timed batches)",
          f"{a['slots_filled']:.3f}",
          f"{b['slots_filled']:.3f}",
      ),
      ("examples per row", f"{a['examples_per_row']:.1f}", f"{b['examples_per_row']:.1f}"),
      (
          "real tokens/s (train step, median of rounds)",
          f"{a['real_tokens_per_s']:,.0f}",
          f"{b['real_tokens_per_s']:,.0f}",
      ),
      ("ms per step (median)", f"{a['step_ms']:.1f}", f"{b['step_ms']:.1f}"),
      (
          "compile s",
          f"{statistics.mean(a['compile_s'].values()):.1f}",
          f"{statistics.mean(b['compile_s'].values()):.1f}",
      ),
  ]
  head = (
      f"`{rec['config']}` (kernel {rec['kernel']}, schemes {', '.join(rec['schemes'])}); "
      f"{rec['examples']:,} line examples, mean {rec['mean_example_tokens']:.1f} tokens, rows of "
      f"{rec['row_length']}, batch {rec['batch_size']}\n\n"
  )
  lines = [head + "| measure | padded (one line per row) | packed (data.pack) |", "|---|---|---|"]
  lines += [f"| {m} | {x} | {y} |" for m, x, y in rows]
  lines.append("")
  lines += [f"- {'PASS' if ok else 'FAIL'}: {what}" for what, ok in verdicts]
  return "\n".join(lines)


def _grad_of(fn):
  return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), (0, 1, 2)))


def _measure_bidirectional(args) -> dict:
  """Bidirectional linear attention over packed rows, fwd+bwd: the segment sums by two
  segment-reset scans against a one-hot ``[N, G]`` matmul, and the unpacked op (one state per
  row, the cost to match), side by side (float32, b=4, h=4, m=d=64)."""
  from fastpos.ops import attention as ops

  b, h, m, d = 4, 4, 64, 64
  rec = {"shape": dict(batch=b, heads=h, m=m, d=d), "rows": []}
  for n in (256, 1024):
    rng = np.random.default_rng(0)
    fq, fk = (rng.uniform(0.1, 1, (b, n, h, m)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(b, n, h, d)).astype(np.float32)
    for g in (2, 8, 32):
      ids = np.repeat(np.arange(1, g + 1), -(-n // g))[:n][None].repeat(b, 0).astype(np.int32)

      fns = {
          "unpacked": _grad_of(lambda q, k, vv: ops.linear_attention(q, k, vv)),
          "scans": _grad_of(lambda q, k, vv, i=ids: ops.linear_attention(q, k, vv, segment_ids=i)),
          "one_hot": _grad_of(
              lambda q, k, vv, i=ids, g=g: ops.segmented_linear_attention(
                  q, k, vv, i, num_segments=g + 1
              )
          ),
      }
      for fn in fns.values():
        jax.block_until_ready(fn(fq, fk, v))
      times = {name: [] for name in fns}
      for _ in range(args.rounds):
        for name, fn in fns.items():
          start = time.perf_counter()
          for _ in range(3):
            jax.block_until_ready(fn(fq, fk, v))
          times[name].append((time.perf_counter() - start) / 3)
      row = {"n": n, "segments": g, **{f: statistics.median(t) for f, t in times.items()}}
      rec["rows"].append(row)
      print(row, flush=True)
  return rec


def _bidirectional_table(rec: dict) -> str:
  lines = [
      "| N | segments per row | unpacked op ms | two scans ms (x unpacked) | one-hot ms "
      "(x unpacked) |",
      "|---|---|---|---|---|",
  ]
  for r in rec["rows"]:
    u = r["unpacked"]
    lines.append(
        f"| {r['n']} | {r['segments']} | {1e3 * u:.1f} | {1e3 * r['scans']:.1f} "
        f"({r['scans'] / u:.2f}x) | {1e3 * r['one_hot']:.1f} ({r['one_hot'] / u:.2f}x) |"
    )
  return "\n".join(lines)


def _slots(batches) -> tuple[int, int]:
  real = sum(int(b["mask"].sum()) for b in batches)
  return real, sum(int(b["mask"].size) for b in batches)


def _take(it, n: int) -> list[dict]:
  return [next(it) for _ in range(n)]


def time_steps(fns, states, batches, rng, rounds: int) -> tuple[dict, dict]:
  """Compiles each variant's step once per batch width and runs it there, then times
  ``rounds`` interleaved passes over each variant's batches (``states`` is updated in place).

  Returns ``({name: {width: compile s}}, {name: [s per pass]})``.
  """
  compile_s = {name: {} for name in batches}
  for name, bs in batches.items():
    for b in bs:
      width = b["inputs"].shape[1]
      if width not in compile_s[name]:
        start = time.perf_counter()
        fns[name].lower(states[name], b, rng).compile()
        compile_s[name][width] = time.perf_counter() - start
        states[name], m = fns[name](states[name], b, rng)
        jax.block_until_ready(m)
  times = {name: [] for name in batches}
  for _ in range(rounds):
    for name, bs in batches.items():
      start = time.perf_counter()
      for b in bs:
        states[name], m = fns[name](states[name], b, rng)
      jax.block_until_ready(m)
      times[name].append(time.perf_counter() - start)
  return compile_s, times


def _measure(args) -> dict:
  before, after = _configs(tuple(args.buckets), args.window)
  runs = {
      "before": run_lib.build_run(before, "/tmp/unused"),
      "after": run_lib.build_run(after, "/tmp/unused"),
  }
  rec = {
      "buckets": list(bucket_lengths(runs["after"].cfg, runs["after"].info.max_length)),
      "window": args.window,
      "batch_size": before.batch_size,
      "num_train_steps": before.num_train_steps,
      "variants": {},
  }
  src = runs["before"].task.source("train")
  val = runs["before"].task.source("validation")
  # One jitted step per variant: each compiles its own shapes (its compile times are its own).
  fns = {
      name: jax.jit(
          without_carry(make_train_step(run.model, run.tx, run.info.kind, 1)), donate_argnums=0
      )
      for name, run in runs.items()
  }
  for name, run in runs.items():
    count = _take(data_lib.train_iterator(src, run.cfg), args.count_steps)
    real, slots = _slots(count)
    v_real, v_slots = _slots(list(data_lib.eval_iterator(val, run.cfg)))
    widths = sorted({b["inputs"].shape[1] for b in count})
    rec["variants"][name] = {
        "train_real_tokens": real,
        "train_slots": slots,
        "train_fraction": real / slots,
        "eval_fraction": v_real / v_slots,
        "widths": widths,
        "width_share": {
            w: sum(b["inputs"].shape[1] == w for b in count) / len(count) for w in widths
        },
    }
  states = {name: run.init_state()[0] for name, run in runs.items()}
  batches = {
      name: _take(data_lib.train_iterator(src, run.cfg), args.steps) for name, run in runs.items()
  }
  rng = runs["before"].train_rng
  compile_s, times = time_steps(fns, states, batches, rng, args.rounds)
  for name in batches:
    rec["variants"][name]["compile_s"] = compile_s[name]
  for name, bs in batches.items():
    v = rec["variants"][name]
    real = sum(int(b["mask"].sum()) for b in bs)
    rates = [real / t for t in times[name]]
    v["timed_real_tokens"] = real
    v["seconds_per_round"] = times[name]
    v["real_tokens_per_s"] = statistics.median(rates)
    v["step_ms"] = 1e3 * statistics.median(times[name]) / len(bs)
    # Every bucket the full run meets compiles once (the timed steps may meet fewer).
    per_compile = statistics.mean(v["compile_s"].values())
    v["estimated_run_s"] = (
        len(v["widths"]) * per_compile + rec["num_train_steps"] * v["step_ms"] / 1e3
    )
  return rec


def _table(rec: dict, verdicts: list[tuple[str, bool]]) -> str:
  b, a = rec["variants"]["before"], rec["variants"]["after"]
  rows = [
      (
          "token slots filled, training (first %d batches)" % rec["num_train_steps"],
          f"{b['train_fraction']:.3f}",
          f"{a['train_fraction']:.3f}",
      ),
      ("token slots filled, validation", f"{b['eval_fraction']:.3f}", f"{a['eval_fraction']:.3f}"),
      (
          "batch widths (share of batches)",
          ", ".join(f"{w} ({s:.0%})" for w, s in b["width_share"].items()),
          ", ".join(f"{w} ({s:.0%})" for w, s in a["width_share"].items()),
      ),
      (
          "real tokens/s (train step, median of rounds)",
          f"{b['real_tokens_per_s']:,.0f}",
          f"{a['real_tokens_per_s']:,.0f}",
      ),
      ("ms per step (median)", f"{b['step_ms']:.1f}", f"{a['step_ms']:.1f}"),
      (
          "compile s per batch width",
          ", ".join(f"{w}: {s:.1f}" for w, s in b["compile_s"].items()),
          ", ".join(f"{w}: {s:.1f}" for w, s in a["compile_s"].items()),
      ),
      (
          "estimated main-job wall: compiles + %d steps (s)" % rec["num_train_steps"],
          f"{b['estimated_run_s']:.0f}",
          f"{a['estimated_run_s']:.0f}",
      ),
  ]
  lines = ["| measure | padded to 100 | bucketed %s |" % rec["buckets"], "|---|---|---|"]
  lines += [f"| {m} | {x} | {y} |" for m, x, y in rows]
  lines.append("")
  lines += [f"- {'PASS' if ok else 'FAIL'}: {what}" for what, ok in verdicts]
  return "\n".join(lines)


def _verdicts(rec: dict) -> list[tuple[str, bool]]:
  b, a = rec["variants"]["before"], rec["variants"]["after"]
  speed = a["real_tokens_per_s"] / b["real_tokens_per_s"]
  rec["speedup"] = speed
  return [
      (
          f"token slots filled with bucketing {a['train_fraction']:.3f} >= {SLOT_GOAL}",
          a["train_fraction"] >= SLOT_GOAL,
      ),
      (f"real tokens/s with bucketing {speed:.2f}x without >= {SPEED_GOAL}x", speed >= SPEED_GOAL),
  ]


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
      "--buckets",
      type=lambda s: [int(x) for x in s.split(",")],
      default=[],
      help="bucket lengths (default: those of listops_generated.py:bucket)",
  )
  p.add_argument("--window", type=int, default=16)
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--count_steps", type=int, default=600)
  p.add_argument("--out", default="")
  p.add_argument("--part", choices=("bucketing", "lm", "bidirectional"), default="bucketing")
  p.add_argument("--lm_config", default="vim,kernel=elu1", help="configs/text_lm.py arguments")
  try:
    args = p.parse_args(argv)
  except SystemExit as e:
    return 2 if e.code else 0
  if min(args.steps, args.rounds, args.count_steps) < 1:
    print("--steps, --rounds and --count_steps must be >= 1.", file=sys.stderr)
    return 2
  if args.part == "bidirectional":
    rec = _measure_bidirectional(args)
    table = _bidirectional_table(rec)
    print(table)
    report.write(args.out, "padding_bidirectional", table, rec)
    return 0
  try:
    rec = _measure(args) if args.part == "bucketing" else _measure_lm(args)
  except ValueError as e:  # a bad --buckets / --window / --lm_config (the config's message)
    print(str(e).splitlines()[0], file=sys.stderr)
    return 2
  if args.part == "lm":
    return _report_lm(rec, argv, args.out)
  verdicts = _verdicts(rec)
  load = os.getloadavg()[0]
  rec.update(
      command=report.command("padding", argv),
      load_average=load,
      machine=platform.node(),
      jax=jax.__version__,
      platform=jax.default_backend(),
      date=time.strftime("%Y-%m-%d"),
  )
  cells, rec["cells"] = cell_table()
  table = (
      f"`{rec['command']}` ({jax.default_backend()}, jax {jax.__version__}, "
      f"{rec['date']}, load average {load:.1f})\n\n"
      + _table(rec, verdicts)
      + "\n\nWhich cells pack and which bucket:\n\n"
      + cells
  )
  print(table)
  report.write(args.out, "padding", table, rec)
  return 0 if all(ok for _, ok in verdicts) else 1


def _report_lm(rec: dict, argv: list[str], out: str) -> int:
  a, b = rec["variants"]["padded"], rec["variants"]["packed"]
  speed = b["real_tokens_per_s"] / a["real_tokens_per_s"]
  rec["speedup"] = speed
  verdicts = [(f"real tokens/s packed {speed:.2f}x padded >= {SPEED_GOAL}x", speed >= SPEED_GOAL)]
  load = os.getloadavg()[0]
  rec.update(
      command=report.command("padding", argv),
      load_average=load,
      jax=jax.__version__,
      platform=jax.default_backend(),
      date=time.strftime("%Y-%m-%d"),
  )
  table = (
      f"`{rec['command']}` ({jax.default_backend()}, jax {jax.__version__}, {rec['date']}, "
      f"load average {load:.1f})\n\n" + _lm_table(rec, verdicts)
  )
  print(table)
  report.write(out, "padding_lm", table, rec)
  return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
