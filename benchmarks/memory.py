"""Train-step memory against ``model.remat``, ``model.scan_layers`` and ``model.mlp_chunk``, and
compile time against depth: ``python -m benchmarks memory``.

The LRA Text model of configs/lra_text_fastrpb.py (SIKF + absolute + FastRPB, 4 layers, width
256, 4 heads, MLP 1024, dropout 0.1, CLS pooling) and its train step (value_and_grad of the
cross-entropy, global-norm clip, AdamW; parameters and optimizer state donated), compiled
only: every figure is ``memory_analysis()`` of the executable (temp + arguments + outputs -
aliased), nothing is run. Per setting (remat x scan x mlp_chunk): bytes of temporary memory per
token per layer at batch 1, N = ``--length``; the paper setting (batch 32, N = 4000); the
longest batch-1 N (a multiple of ``--granularity``) whose step fits ``--budget-gib``:
predicted from the two compiled points (memory is affine in the tokens of a batch for linear
attention), then confirmed by compiling at the prediction and stepping by the granularity
until the boundary (the one that fits and the next that does not, both compiled). Compile
time against depth: the step at batch 1, N = ``--depth-length``, for each depth, scanned and
unrolled, side by side.

Targets (PASS / FAIL): the paper setting under 8 GB (1e9 bytes) and the longest batch-1 N over
360K tokens, for the best setting; scanned compile time at the deepest depth within 1.5x of
the shallowest. Exit 0 when every target passes, 1 otherwise, 2 for a bad flag (one line).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import jax
import jax.numpy as jnp
import optax

from benchmarks import report
from benchmarks.measure import fmt_bytes
from fastpos.models import REMAT_POLICIES, TaskInfo, build_model, model_config

PAPER = (32, 4000)  # LRA Text: batch 32, N = 4000
GOAL_PAPER_BYTES = 8e9
GOAL_LONGEST = 360_000
GOAL_DEPTH_RATIO = 1.5


def model_fields(
    remat: str, scan: bool, layers: int = 4, smoke: bool = False, mlp_chunk: int = 0
) -> dict:
  """The ``config.model`` fields of the measured model (configs/lra_text_fastrpb.py's)."""
  fields = dict(
      kernel="sikf",
      positional="absolute,fastrpb",
      pooling="cls",
      num_layers=layers,
      remat=remat,
      scan_layers=scan,
      mlp_chunk=mlp_chunk,
  )
  if smoke:
    fields.update(embed_dim=32, num_heads=2, mlp_dim=64)
  return fields


def compile_step(fields: dict, batch: int, length: int):
  """``(memory_analysis, compile seconds)`` of the model's train step, compiled only."""
  cfg = model_config()
  cfg.update(fields)
  task = TaskInfo("classify", vocab_size=257, num_classes=2, max_length=length)
  model = build_model(cfg, task)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(5e-4, weight_decay=0.1))
  example = {
      "inputs": jax.ShapeDtypeStruct((batch, length), jnp.int32),
      "mask": jax.ShapeDtypeStruct((batch, length), jnp.bool_),
  }
  variables = jax.eval_shape(model.init, jax.random.key(0), example)
  opt_state = jax.eval_shape(tx.init, variables)
  targets = jax.ShapeDtypeStruct((batch,), jnp.int32)

  def step(variables, opt_state, batch_, targets, rng):
    def loss_fn(v):
      logits = model.apply(v, batch_, train=True, rngs={"dropout": rng})
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = jax.value_and_grad(loss_fn)(variables)
    updates, opt_state = tx.update(grads, opt_state, variables)
    return optax.apply_updates(variables, updates), opt_state, loss

  rng = jax.eval_shape(lambda: jax.random.key(0))
  start = time.perf_counter()
  exe = (
      jax.jit(step, donate_argnums=(0, 1))
      .lower(variables, opt_state, example, targets, rng)
      .compile()
  )
  return exe.memory_analysis(), time.perf_counter() - start


def total_bytes(mem) -> int:
  """What an executable holds (its ``memory_analysis()``): temporaries, arguments and outputs,
  less the outputs aliased to (donated) arguments."""
  return int(
      mem.temp_size_in_bytes
      + mem.argument_size_in_bytes
      + mem.output_size_in_bytes
      - mem.alias_size_in_bytes
  )


def analysis_bytes(mem) -> dict[str, int]:
  """An executable's ``memory_analysis()`` as the benchmarks record it: ``{"temp",
  "arguments", "outputs", "alias", "total"}`` in bytes (per device; ``total_bytes``)."""
  return {
      "temp": int(mem.temp_size_in_bytes),
      "arguments": int(mem.argument_size_in_bytes),
      "outputs": int(mem.output_size_in_bytes),
      "alias": int(mem.alias_size_in_bytes),
      "total": total_bytes(mem),
  }


def longest(fields: dict, points: list[tuple[int, int]], budget: float, step: int, log):
  """The longest batch-1 N (a multiple of ``step``) whose step fits ``budget`` bytes, from the
  affine fit of ``points`` [(tokens, bytes)], refined by secants through the batch-1 compiles
  (batch-1 memory is affine in N), confirmed by compiling; ``(n, bytes at n, bytes at
  n + step, compiles)``."""
  seen = {}

  def fits(k):
    if k not in seen:
      seen[k] = total_bytes(compile_step(fields, 1, k)[0])
      log(f"    N={k}: {fmt_bytes(seen[k])}")
    return seen[k] <= budget

  def predict(a, b):
    (t0, m0), (t1, m1) = a, b
    return max(step, int((t0 + (budget - m0) * (t1 - t0) / (m1 - m0)) // step * step))

  n = predict(*points)
  for _ in range(3):  # secants from the first batch-1 point: exact when memory is affine
    if n in seen:
      break
    fits(n)
    n = predict(points[0], (n, seen[n]))
  fitting = [k for k in seen if seen[k] <= budget]
  n = max(fitting) if fitting else max(step, min(seen) - step)
  if fits(n):
    while fits(n + step):
      n += step
  else:
    while n > step and not fits(n - step):
      n -= step
    n -= step
  return n, seen.get(n), seen.get(n + step), len(seen)


def measure_setting(remat: str, scan: bool, chunk: int, args, log) -> dict:
  fields = model_fields(remat, scan, smoke=args.smoke, mlp_chunk=chunk)
  layers = fields["num_layers"]
  one, one_s = compile_step(fields, 1, args.length)
  paper, _ = compile_step(fields, *PAPER)
  per_token = one.temp_size_in_bytes / (args.length * layers)
  log(
      f"  remat={remat} scan={scan} mlp_chunk={chunk}: {per_token / 1e3:.1f} KB/token/layer at "
      f"N={args.length}, "
      f"paper setting {fmt_bytes(total_bytes(paper))}"
  )
  points = [(args.length, total_bytes(one)), (PAPER[0] * PAPER[1], total_bytes(paper))]
  n, at_n, above, compiles = longest(fields, points, args.budget_gib * 2**30, args.granularity, log)
  return {
      "remat": remat,
      "scan_layers": scan,
      "mlp_chunk": chunk,
      "bytes_per_token_layer": per_token,
      "temp_bytes": int(one.temp_size_in_bytes),
      "total_bytes": total_bytes(one),
      "paper_bytes": total_bytes(paper),
      "paper_temp_bytes": int(paper.temp_size_in_bytes),
      "longest_n": n,
      "bytes_at_longest": at_n,
      "bytes_above_longest": above,
      "longest_compiles": compiles,
      "compile_s": one_s,
  }


def measure_depth(args, log) -> list[dict]:
  rows = []
  for depth in args.depths:
    row = {"layers": depth}
    for scan in (False, True):
      _, secs = compile_step(model_fields("none", scan, depth, args.smoke), 1, args.depth_length)
      row["scan_s" if scan else "unrolled_s"] = secs
    log(f"  {depth} layers: unrolled {row['unrolled_s']:.1f} s, scanned {row['scan_s']:.1f} s")
    rows.append(row)
  return rows


def _name(s: dict) -> str:
  return f"remat={s['remat']}, scan={s['scan_layers']}, mlp_chunk={s.get('mlp_chunk', 0)}"


def _tables(settings: list[dict], depth: list[dict], args) -> tuple[str, list]:
  head = [
      "remat",
      "scan_layers",
      "mlp_chunk",
      "temp KB / token / layer",
      "paper setting (b=32, N=4000)",
      f"longest batch-1 N in {args.budget_gib:g} GiB",
  ]
  rows = [
      [
          s["remat"],
          str(s["scan_layers"]),
          str(s.get("mlp_chunk", 0)),
          f"{s['bytes_per_token_layer'] / 1e3:.1f}",
          f"{fmt_bytes(s['paper_bytes'])} ({s['paper_bytes'] / 1e9:.2f} GB)",
          f"{s['longest_n']:,}",
      ]
      for s in settings
  ]
  base = next(
      (
          s
          for s in settings
          if s["remat"] == "none" and not s["scan_layers"] and not s.get("mlp_chunk")
      ),
      None,
  )
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  lines += ["", "| layers | unrolled compile s | scanned compile s |", "|---:|---:|---:|"]
  lines += [f"| {d['layers']} | {d['unrolled_s']:.1f} | {d['scan_s']:.1f} |" for d in depth]
  targets = []
  if settings:
    best_paper = min(settings, key=lambda s: s["paper_bytes"])
    best_long = max(settings, key=lambda s: s["longest_n"])
    targets = [
        (
            f"LRA Text paper setting (batch 32, N=4000) under {GOAL_PAPER_BYTES / 1e9:g} GB",
            f"{best_paper['paper_bytes'] / 1e9:.2f} GB ({_name(best_paper)})",
            best_paper["paper_bytes"] < GOAL_PAPER_BYTES,
        ),
        (
            f"longest batch-1 train step in {args.budget_gib:g} GiB over {GOAL_LONGEST:,} tokens",
            f"{best_long['longest_n']:,} ({_name(best_long)})",
            best_long["longest_n"] > GOAL_LONGEST,
        ),
    ]
  if len(depth) >= 2:
    r = depth[-1]["scan_s"] / depth[0]["scan_s"]
    targets.append(
        (
            f"scanned compile time flat in depth: {depth[-1]['layers']} layers within "
            f"{GOAL_DEPTH_RATIO}x of {depth[0]['layers']}",
            f"{r:.2f}x",
            r <= GOAL_DEPTH_RATIO,
        )
    )
  if base is not None:
    for s in settings:
      s["memory_vs_baseline"] = s["total_bytes"] / base["total_bytes"]
  lines += ["", "Targets:"] + [f"- {t}: {m} **{'PASS' if ok else 'FAIL'}**" for t, m, ok in targets]
  return "\n".join(lines), targets


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks memory", description=__doc__.split("\n\n")[0]
  )
  p.add_argument("--length", type=int, default=16384, help="batch-1 N of the per-token figure")
  p.add_argument("--budget-gib", type=float, default=16.0)
  p.add_argument("--granularity", type=int, default=4096, help="longest-N search step")
  p.add_argument(
      "--settings",
      default="none:0,block:0,save_matmuls:0,none:1,block:1," "save_matmuls:1",
      help="remat:scan[:mlp_chunk] settings, scan 0 or 1, mlp_chunk >= 0 (default 0)",
  )
  p.add_argument("--depths", default="2,4,8,16")
  p.add_argument("--depth-length", type=int, default=1024)
  p.add_argument("--smoke", action="store_true", help="a width-32 model (a check, no figures)")
  p.add_argument("--out", default="", help="directory for memory.md / memory.json")
  p.add_argument("--name", default="memory", help="file stem of the written table")
  args = p.parse_args(argv)
  try:
    settings = []
    for part in filter(None, args.settings.split(",")):
      fields = part.split(":")
      remat, scan, chunk = (fields + ["0"])[:3] if len(fields) in (2, 3) else ("", "", "")
      if remat not in REMAT_POLICIES or scan not in ("0", "1") or not chunk.isdigit():
        raise ValueError(
            f"--settings: bad setting {part!r}; give remat:scan[:mlp_chunk] with remat in "
            f"{', '.join(REMAT_POLICIES)}, scan 0 or 1 and mlp_chunk an int >= 0."
        )
      settings.append((remat, scan == "1", int(chunk)))
    args.depths = [int(d) for d in args.depths.split(",") if d]
    if any(d < 1 for d in args.depths) or args.length < 1 or args.granularity < 1:
      raise ValueError("--depths, --length and --granularity must be positive.")
  except ValueError as e:
    print(f"benchmark memory: {e}", file=sys.stderr)
    return 2
  log = lambda msg: print(msg, file=sys.stderr, flush=True)
  log(f"memory: {len(settings)} settings, N={args.length}, budget {args.budget_gib} GiB")
  measured = [measure_setting(r, s, c, args, log) for r, s, c in settings]
  depth = measure_depth(args, log)
  table, targets = _tables(measured, depth, args)
  title = (
      "# Train-step memory: model.remat x model.scan_layers x model.mlp_chunk (LRA Text, "
      "SIKF + absolute + "
      "FastRPB, 4 x 256)\n\n" + f"{platform.processor() or platform.machine()}, "
      f"jax {jax.__version__}, {jax.devices()[0].platform}; compiled only "
      "(memory_analysis: temp + arguments + outputs - aliased; float32).\n\n"
  )
  print(title + table)
  report.write(
      args.out,
      args.name,
      title + table,
      {
          "settings": measured,
          "depth": depth,
          "length": args.length,
          "budget_gib": args.budget_gib,
          "granularity": args.granularity,
          "smoke": args.smoke,
          "targets": [{"target": t, "measured": m, "passed": ok} for t, m, ok in targets],
          "jax": jax.__version__,
          "platform": jax.devices()[0].platform,
      },
  )
  return 0 if all(ok for _, _, ok in targets) else 1


if __name__ == "__main__":
  sys.exit(main())
