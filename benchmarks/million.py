"""A million-token train step over devices (``mesh.seq``): ``python -m benchmarks million``.

The trainer's train step (AdamW, dropout, the jit shardings and parameter sharding rules of
``fastpos.train``) of the LRA Text-sized SIKF + absolute + FastRPB classifier (4 layers, width
256, 4 heads, MLP 1024, mean pooling, batch 1, float32) at N = 1,048,576 tokens is compiled
with the sequence split over ``--seq`` devices, and the compiled executable's
``memory_analysis()`` read (it is per device): arguments (the train state's shards and the
batch), temporaries (activations kept for the backward pass, gradients, FFT buffers) and the
total (arguments + outputs + temporaries - donated aliases). Variants: the absolute table
learned (sharded over "seq" by the trainer's position rules, or replicated as before) or
sinusoidal (no table); each ``--remat`` policy (``model.remat``, with ``model.scan_layers``),
each with every ``--mlp_chunk`` (``model.mlp_chunk``: the blocks' token-wise part in chunks)
and every ``--attn_chunk`` (``model.attn_chunk``: the attention layers in chunks).

Breakdown: the per-device bytes of each part of the train state come from its shardings; what
each further layer adds from a compile with one layer (``(temp(L) - temp(1)) / (L - 1)``, with
remat the activations a layer keeps); and what dominates a layer's own working set (the one
layer whose backward runs at a time) from one-layer compiles without a part
(``ABLATIONS``): the difference in temporaries is that part's share.

Time cost of the chunking (``--time_length`` N > 0): forward + backward (``value_and_grad`` of
the train loss, dropout on) of the same model on one device at N tokens, the first variant's
settings against the same with ``attn_chunk=0`` (and ``mlp_chunk=0``), interleaved repeats
in one process, medians and their ratio.

Then, when ``--run`` allows and there is enough memory (on a CPU host ``free`` shows the
devices x the total per device + 4 GiB; on an accelerator the device's memory holds the
total), the first variant's step runs once: state initialised on the devices, one call, its
wall time, the loss, the process's peak resident memory (``ru_maxrss``) and, where the
device reports it, the device's peak memory in use.

``--seq=1`` puts the whole sequence on one device (no ring, e.g. one GPU); the record names
the device kind. On a CPU host the ``--seq`` devices are simulated
(``--xla_force_host_platform_device_count``, set here before JAX starts). Exit 0 when the
first variant fits ``--budget`` GiB per device, 1 when it does not, 2 for a bad flag (one
line).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import context_parallel, report
from benchmarks import memory as bench_memory
from fastpos.models import TaskInfo, build_model
from fastpos.train import sharding as sharding_lib

GIB = 2**30
# One-layer compiles without a part of the layer: model field overrides.
ABLATIONS = {
    "FastRPB (ring Toeplitz product)": {"positional": "absolute"},
    "dropout (rate 0.1 -> 0)": {"dropout_rate": 0.0},
    "MLP hidden 1024 -> 256": {"mlp_dim": 256},
}
# Variant name -> (absolute table kind, position table sharded over "seq").
POSITIONS = {
    "learned": ("learned", True),
    "learned-replicated": ("learned", False),
    "sinusoidal": ("sinusoidal", True),
}


def make_config(
    n: int,
    seq: int,
    positions: str,
    remat: str | None,
    layers: int = 4,
    mlp_chunk: int = 0,
    attn_chunk: int = 0,
):
  """The LRA Text-sized SIKF + absolute + FastRPB classifier at length ``n`` over ``seq``
  (``context_parallel.text_config``)."""
  c = context_parallel.text_config("sikf", "absolute,fastrpb", seq, layers)
  c.model.positional_options = {"absolute": {"kind": POSITIONS[positions][0]}}
  if remat is not None:
    if "remat" not in c.model:
      raise ValueError(f"--remat={remat!r}: this model has no model.remat field.")
    c.model.remat = remat
    c.model.scan_layers = True  # XLA:CPU honours a remat policy under a scan over the layers
  if mlp_chunk:
    c.model.mlp_chunk = mlp_chunk
  if attn_chunk:
    c.model.attn_chunk = attn_chunk
  return c


def _shard_bytes(leaf) -> int:
  shape = leaf.sharding.shard_shape(leaf.shape)
  return int(np.prod(shape, dtype=np.int64)) * leaf.dtype.itemsize


def _state_parts(state) -> dict:
  """Per-device bytes of the train state: position table, FastRPB tables, the rest (each with
  its optimizer moments)."""
  parts = {"position table": 0, "fastrpb tables": 0, "other parameters": 0}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    name = sharding_lib.leaf_name(path)
    key = (
        "position table"
        if "pos_absolute/" in name
        else "fastrpb tables"
        if "pos_fastrpb/" in name
        else "other parameters"
    )
    parts[key] += _shard_bytes(leaf)
  return parts


def compile_step(cfg, n: int) -> dict:
  """Compiles the train step of ``cfg`` at ``n``: per-device bytes and the compiled step."""
  task = TaskInfo("classify", 257, 2, n)
  step, state, batch, rng, init_fn = context_parallel.build_step(cfg, task, n)
  start = time.perf_counter()
  compiled = step.lower(state, batch, rng).compile()
  seconds = time.perf_counter() - start
  return {
      **bench_memory.analysis_bytes(compiled.memory_analysis()),
      "state": _state_parts(state),
      "compile_s": seconds,
      "_run": (compiled, state, batch, init_fn),
  }


def available_bytes() -> int:
  """MemAvailable of /proc/meminfo (0 where it cannot be read)."""
  try:
    with open("/proc/meminfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def device_bytes() -> tuple[int | None, int | None]:
  """(memory limit, peak bytes in use) of the first device, where it reports them (GPUs and
  TPUs do; simulated CPU devices do not: None)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_limit"), stats.get("peak_bytes_in_use")


def run_once(compiled, state, batch, init_fn, n: int) -> dict:
  """Initialises the state on the devices and runs the compiled step once: wall seconds of
  the state's initialisation and of the step, the loss, the process's peak resident memory
  and the first device's peak memory in use (None where it is not reported)."""
  start = time.perf_counter()
  real = init_fn(jax.random.key(0))
  jax.block_until_ready(real)
  init_s = time.perf_counter() - start
  rng_np = np.random.default_rng(0)
  host = {
      "inputs": rng_np.integers(1, 257, (1, n), dtype=np.int32),
      "mask": np.ones((1, n), bool),
      "weight": np.ones((1,), np.float32),
      "targets": np.zeros((1,), np.int32),
  }
  data = {k: jax.device_put(v, batch[k].sharding) for k, v in host.items()}
  rng = jax.device_put(jax.random.key_data(jax.random.key(1)), state.step.sharding)
  start = time.perf_counter()
  new_state, metrics = compiled(real, data, rng)
  jax.block_until_ready((new_state, metrics))
  step_s = time.perf_counter() - start
  metrics = {k: float(np.asarray(v[0]) / np.asarray(v[1])) for k, v in metrics.items()}
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return {
      "init_s": init_s,
      "step_s": step_s,
      "peak_rss": int(peak),
      "device_peak": device_bytes()[1],
      "metrics": metrics,
  }


def time_chunking(n: int, positions, remat, chunks, layers: int, repeats: int = 3) -> dict:
  """Median seconds of fwd+bwd (the train loss's ``value_and_grad``, dropout on) of the model
  at ``n`` tokens on one device: with ``chunks`` = (mlp_chunk, attn_chunk) and with neither
  (the same remat), interleaved in one process."""
  task = TaskInfo("classify", 257, 2, n)
  ids = jnp.asarray(np.random.default_rng(0).integers(1, 257, (1, n)), jnp.int32)
  batch = {"inputs": ids, "mask": jnp.ones((1, n), bool)}
  fns, params = {}, None
  for name, c in (("chunked", chunks), ("unchunked", (0, 0))):
    model = build_model(make_config(n, 1, positions, remat, layers, *c).model, task)
    if params is None:
      params = model.init(jax.random.key(0), batch)["params"]

    def loss(p, model=model):
      out = model.apply({"params": p}, batch, train=True, rngs={"dropout": jax.random.key(1)})
      return jnp.sum(jax.nn.log_softmax(out)[:, 0])

    fns[name] = jax.jit(jax.value_and_grad(loss))
    jax.block_until_ready(fns[name](params))  # compile and warm up
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(params))
      times[name].append(time.perf_counter() - start)
  med = {name: float(np.median(t)) for name, t in times.items()}
  return {
      "length": n,
      "chunks": list(chunks),
      "times": times,
      "median": med,
      "ratio": med["chunked"] / med["unchunked"],
  }


def _timing_line(t: dict) -> str:
  c, a = t["chunks"]
  return (
      f"Time cost of the chunking (fwd+bwd of the same model on one device at N = "
      f"{t['length']:,}, dropout on, median of {len(t['times']['chunked'])} interleaved runs): "
      f"mlp_chunk={c}, attn_chunk={a}: {t['median']['chunked']:.2f} s; unchunked: "
      f"{t['median']['unchunked']:.2f} s; ratio {t['ratio']:.2f}x."
  )


def device_kind() -> str:
  """The first device's kind as JAX names it (e.g. "cpu", "NVIDIA H100 80GB HBM3")."""
  return str(jax.devices()[0].device_kind)


def _gib(nbytes: float) -> str:
  return f"{nbytes / GIB:,.2f} GiB"


def _parse(argv):
  prog = "python -m benchmarks million"
  parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
  parser.add_argument("--length", type=int, default=2**20, help="tokens per sequence")
  parser.add_argument(
      "--seq", type=int, default=8, help="mesh.seq (devices; 1: the whole sequence on one)"
  )
  parser.add_argument(
      "--positions",
      default="learned,learned-replicated,sinusoidal",
      help=f"variants, comma-separated: {', '.join(POSITIONS)}",
  )
  parser.add_argument(
      "--remat",
      default="",
      help="model.remat policies, comma-separated "
      "(each with the first --positions variant); empty: none",
  )
  parser.add_argument(
      "--mlp_chunk",
      default="0",
      help="model.mlp_chunk values, comma-separated (each with every --remat policy; 0: off)",
  )
  parser.add_argument(
      "--attn_chunk",
      default="0",
      help="model.attn_chunk values, comma-separated (each with every --mlp_chunk; 0: off)",
  )
  parser.add_argument(
      "--time_length",
      type=int,
      default=0,
      help="N > 0: time fwd+bwd at N tokens on one device, first variant vs unchunked",
  )
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument(
      "--breakdown",
      type=int,
      default=1,
      help="1: compile the first variant with one layer too (per-layer bytes)",
  )
  parser.add_argument("--budget", type=float, default=2.5, help="goal, GiB per device")
  parser.add_argument(
      "--run",
      default="auto",
      choices=("auto", "never", "always"),
      help="run the first variant's step once (auto: if free memory allows)",
  )
  parser.add_argument("--out", default="", help="folder for million.md / .json")
  args = parser.parse_args(argv)
  positions = [p.strip() for p in args.positions.split(",") if p.strip()]
  for p in positions:
    if p not in POSITIONS:
      raise ValueError(
          f"--positions: unknown variant {p!r}; valid choices: " f"{', '.join(POSITIONS)}."
      )
  if not positions:
    raise ValueError(f"--positions is empty; valid choices: {', '.join(POSITIONS)}.")
  if args.seq < 1 or args.length < args.seq or args.length % args.seq:
    raise ValueError(f"--seq={args.seq} must be >= 1 and divide --length={args.length}.")
  if args.layers < 2:
    raise ValueError(f"--layers={args.layers} must be >= 2 (the breakdown compiles 1).")
  remat = [r.strip() for r in args.remat.split(",") if r.strip()]
  args.chunks = _ints("--mlp_chunk", args.mlp_chunk)
  args.attn_chunks = _ints("--attn_chunk", args.attn_chunk)
  if args.time_length < 0:
    raise ValueError(f"--time_length={args.time_length} must be >= 0 (0: no timing).")
  return prog, args, positions, remat


def _ints(flag: str, text: str) -> list[int]:
  values = [c.strip() for c in text.split(",") if c.strip()]
  if not values or not all(c.isdigit() for c in values):
    raise ValueError(f"{flag}={text!r}: give ints >= 0, comma-separated.")
  return [int(c) for c in values]


def _variants(positions, remat, chunks, attn_chunks=(0,)):
  """[(label, positions, remat, (mlp_chunk, attn_chunk))], the first one the headline."""
  out = []
  for r in remat:
    for c in chunks:
      for a in attn_chunks:
        name = f"remat={r}" + (f", mlp_chunk={c}" if c else "") + (f", attn_chunk={a}" if a else "")
        out.append((f"{positions[0]}, {name} (scanned layers)", positions[0], r, (c, a)))
  for p in positions:
    out.append((f"{p}, no remat" if remat else p, p, None, (0, 0)))
  return out


def _breakdown(args, n, head, head_variant, results) -> tuple[float, dict]:
  """One layer's temp memory and, per ablated part, its share of it; adds the one-layer
  compile to ``results``."""
  head_pos, head_remat, head_chunk = head_variant
  cfg = make_config(n, args.seq, head_pos, head_remat, 1, *head_chunk)
  one = compile_step(cfg, n)
  one.pop("_run")
  per_layer = (head["temp"] - one["temp"]) / (args.layers - 1)
  results["one layer"] = one
  print(
      f"one layer: temp {_gib(one['temp'])}; per layer {_gib(per_layer)} "
      f"({per_layer / (n / args.seq) / 1024:.1f} KiB per token)",
      flush=True,
  )
  parts = {}
  for part, fields in ABLATIONS.items():
    cfg = make_config(n, args.seq, head_pos, head_remat, 1, *head_chunk)
    cfg.model.update(fields)
    r = compile_step(cfg, n)
    parts[part] = {"temp": r["temp"], "share": one["temp"] - r["temp"]}
    print(f"one layer without {part}: temp {_gib(r['temp'])}", flush=True)
  return per_layer, parts


def _maybe_run(args, head: dict, n: int) -> tuple[dict | None, str]:
  """Runs the headline step once when ``--run`` and the host's free memory allow: (the run's
  record or None, one line saying what happened)."""
  run, why = None, ""
  limit = device_bytes()[0]
  if limit is None:  # simulated devices: the host's memory holds all of them
    need, avail = args.seq * head["total"] + 4 * GIB, available_bytes()
    needs = f"{args.seq} x {_gib(head['total'])} + 4 GiB = {_gib(need)}"
  else:
    need, avail, needs = head["total"], limit, f"{_gib(head['total'])} per device"
  if args.run == "never":
    why = "not run (--run=never)"
  elif args.run == "auto" and avail < 1.3 * need:  # a shared host: a 30% margin
    why = f"not run: {_gib(avail)} available, under 1.3 x what the run needs ({needs})"
  else:
    run = run_once(*head["_run"], n)
    device = "" if run["device_peak"] is None else f", device peak {_gib(run['device_peak'])}"
    why = (
        f"ran once: step {run['step_s']:.1f} s (state init {run['init_s']:.1f} s), peak "
        f"resident memory {_gib(run['peak_rss'])} for all {args.seq} device(s){device}, "
        f"loss {run['metrics']['loss']:.4f}, finite: {np.isfinite(run['metrics']['loss'])}"
    )
  return run, why


def main(argv=None) -> int:
  try:
    prog, args, positions, remat = _parse(argv)
  except ValueError as e:
    print(f"python -m benchmarks million: {e}", file=sys.stderr)
    return 2
  if context_parallel.simulated_devices(args.seq) < args.seq:
    print(f"{prog}: --seq needs {args.seq} devices; {jax.device_count()} visible.", file=sys.stderr)
    return 2
  n = args.length
  print(
      f"devices: {jax.device_count()} x {device_kind()} ({jax.devices()[0].platform})", flush=True
  )
  results = {}
  try:
    for label, pos, r, c in _variants(positions, remat, args.chunks, args.attn_chunks):
      cfg = make_config(n, args.seq, pos, r, args.layers, *c)
      if not POSITIONS[pos][1]:
        cfg.mesh.rules = ((r"pos_absolute/table$", (None, None)),)  # the old replication
      res = compile_step(cfg, n)
      results[label] = res
      print(
          f"{label}: temp {_gib(res['temp'])}, arguments {_gib(res['arguments'])}, total "
          f"{_gib(res['total'])} per device (compiled in {res['compile_s']:.0f} s)",
          flush=True,
      )
  except ValueError as e:
    print(f"{prog}: {e}", file=sys.stderr)
    return 2
  variants = _variants(positions, remat, args.chunks, args.attn_chunks)
  head_label, head_pos, head_remat, head_chunk = variants[0]
  head = results[head_label]
  per_layer, parts = None, {}
  if args.breakdown:
    per_layer, parts = _breakdown(args, n, head, (head_pos, head_remat, head_chunk), results)
  timing = None
  if args.time_length:
    timing = time_chunking(args.time_length, head_pos, head_remat, head_chunk, args.layers)

  run, why = _maybe_run(args, head, n)
  print(why, flush=True)
  for r in results.values():
    r.pop("_run", None)

  ok = head["total"] <= args.budget * GIB
  where = (
      f"over mesh.seq = {args.seq} devices ({n // args.seq:,} each)"
      if args.seq > 1
      else "on one device (mesh.seq = 1, no ring)"
  )
  lines = [
      report.headline(
          report.quoted_command(prog, argv), f"{jax.devices()[0].platform}: {device_kind()}"
      ),
      "",
      f"N = {n:,} tokens {where}, per device:",
      "",
      "| variant | position table + moments | other state | temp | total | compile |",
      "|---|---|---|---|---|---|",
  ]
  for label, r in results.items():
    if label == "one layer":
      continue
    s = r["state"]
    lines.append(
        f"| {label} | {_gib(s['position table'])} | "
        f"{_gib(s['fastrpb tables'] + s['other parameters'])} | {_gib(r['temp'])} | "
        f"{_gib(r['total'])} | {r['compile_s']:.0f} s |"
    )
  if per_layer is not None:
    tokens = n / args.seq
    one = results["one layer"]["temp"]
    lines += [
        "",
        f"Breakdown of {head_label}: each further layer adds {_gib(per_layer)} per "
        f"device ({per_layer / tokens / 1024:.1f} KiB per token: temp with "
        f"{args.layers} layers minus temp with 1, over {args.layers - 1}); the step with "
        f"one layer has {_gib(one)} of temporaries ({one / tokens / 1024:.1f} KiB per "
        "token), of which:",
        "",
        "| part of the layer | one-layer temp without it | its share | per token |",
        "|---|---|---|---|",
    ]
    for part, r in parts.items():
      lines.append(
          f"| {part} | {_gib(r['temp'])} | {_gib(r['share'])} | "
          f"{r['share'] / tokens / 1024:.1f} KiB |"
      )
  if timing is not None:
    lines += ["", _timing_line(timing)]
  lines += [
      "",
      f"Run: {why}.",
      "",
      f"- {'PASS' if ok else 'FAIL'}: {head_label}: {_gib(head['total'])} per device "
      f"(goal <= {args.budget:g} GiB)",
  ]
  table = "\n".join(lines)
  print(table)
  report.write(
      args.out,
      "million",
      table,
      {
          "memory": results,
          "per_layer": per_layer,
          "parts": parts,
          "run": run,
          "run_note": why,
          "timing": timing,
          "args": vars(args),
          "device": {"platform": jax.devices()[0].platform, "kind": device_kind()},
          "pass": ok,
      },
  )
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
