"""Decoding speed and state memory against context length: ``python -m benchmarks decode``.

One run measures, side by side, a ``DecoderLM`` whose attention is softmax (a key / value
cache, O(n) per token), linear ELU+1 (a recurrent state, O(1)) and linear ELU+1 + FastRPB
(causal ``W V``: the recurrent state plus a value cache, O(n d)), at each context length
(default 1K, 4K, 16K, 64K): the cache is built for n tokens and its index set to n - S - 1
(a full context: a step's cost does not depend on the cached values), then S tokens are
decoded by one jitted ``lax.scan`` of cached steps, timed over repeats (the fastest, since on
a shared machine the slower repeats measure the neighbours' load). Reported per
cell and length: ms per token, tokens/s and the decoding state's bytes (``cache_bytes``).

Targets (PASS / FAIL): linear time per token flat within 1.3x from the shortest to the
longest context; softmax time per token grows (> 1.3x) over the same range. Writes the
markdown table (and ``decode.json``) to ``--out`` when given. Exit 0 when every target
passes, 1 otherwise, 2 for a bad flag (one line).
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

from benchmarks import report
from fastpos.models import TaskInfo, build_model, decoding, model_config

CELLS = {
    "softmax (KV cache)": ("softmax", "none"),
    "linear ELU+1 (recurrent)": ("elu1", "none"),
    "linear ELU+1 + FastRPB (value cache)": ("elu1", "fastrpb"),
}
FLAT = 1.3  # linear: slowest / fastest per-token time across lengths must stay below this


def _model(kernel: str, scheme: str, max_length: int, width: int, layers: int, heads: int):
  c = model_config()
  c.kernel, c.positional = kernel, scheme
  c.num_layers, c.embed_dim, c.num_heads, c.mlp_dim = layers, width, heads, 4 * width
  c.dropout_rate, c.max_length = 0.0, max_length
  return build_model(c, TaskInfo(kind="lm", vocab_size=1000, max_length=max_length))


def measure(
    kernel: str,
    scheme: str,
    n: int,
    *,
    steps: int,
    repeats: int,
    width: int,
    layers: int,
    heads: int,
) -> dict:
  """ms per token and the state's bytes when decoding at context ``n``."""
  model = _model(kernel, scheme, n, width, layers, heads)
  tok = jnp.ones((1, 1), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), {"inputs": tok})["params"]
  cache = model.init_cache(1, n)
  cache = {**cache, "index": jnp.asarray(n - steps - 1, jnp.int32)}

  @jax.jit
  def run(params, cache):
    def body(carry, _):
      cache, token = carry
      logits, upd = model.apply(
          {"params": params, "cache": cache},
          {"inputs": token, "mask": jnp.ones((1, 1), bool)},
          decode=True,
          mutable=["cache"],
      )
      nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
      return (upd["cache"], nxt), None

    (cache, token), _ = jax.lax.scan(body, (cache, tok), None, length=steps)
    return token

  start = time.perf_counter()
  compiled = run.lower(params, cache).compile()
  compile_s = time.perf_counter() - start
  jax.block_until_ready(compiled(params, cache))  # warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(params, cache))
    times.append((time.perf_counter() - start) / steps)
  # The fastest repeat: on a shared machine the slower ones measure the neighbours' load.
  per_token = min(times)
  return {
      "ms_per_token": 1e3 * per_token,
      "tokens_per_s": 1.0 / per_token,
      "state_bytes": decoding.cache_bytes(cache),
      "compile_s": compile_s,
      "median_ms_per_token": 1e3 * statistics.median(times),
      "spread": (max(times) - min(times)) / per_token,
      "runs": repeats,
  }


def verdicts(results: dict, lengths) -> list[tuple[str, bool, str]]:
  """(target, passed, detail) for each target."""
  out = []
  lo, hi = lengths[0], lengths[-1]
  for name, (kernel, scheme) in CELLS.items():
    times = [results[name][n]["ms_per_token"] for n in lengths]
    ratio = max(times) / min(times)
    if kernel != "softmax" and scheme == "none":
      out.append(
          (
              f"{name}: time per token flat within {FLAT}x from {lo} to {hi}",
              ratio < FLAT,
              f"slowest / fastest = {ratio:.2f}",
          )
      )
    if kernel == "softmax":
      grow = results[name][hi]["ms_per_token"] / results[name][lo]["ms_per_token"]
      out.append(
          (
              f"{name}: time per token grows from {lo} to {hi}",
              grow > FLAT,
              f"{hi} / {lo} = {grow:.2f}",
          )
      )
  return out


def _size(nbytes: int) -> str:
  return f"{nbytes / 2 ** 20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2 ** 10:.1f} KiB"


def markdown(results: dict, lengths, checks, command: str) -> str:
  lines = [
      f"`{command}` ({platform.node() or 'host'}, {jax.devices()[0].platform}, jax "
      f"{jax.__version__}, {time.strftime('%Y-%m-%d')}, load average "
      f"{os.getloadavg()[0]:.1f})",
      "",
      "| cell | context | ms / token | tokens / s | state |",
      "|---|---|---|---|---|",
  ]
  for name in CELLS:
    for n in lengths:
      r = results[name][n]
      lines.append(
          f"| {name} | {n} | {r['ms_per_token']:.3f} | {r['tokens_per_s']:.0f} | "
          f"{_size(r['state_bytes'])} |"
      )
  lines.append("")
  lines += [f"- {'PASS' if ok else 'FAIL'}: {what} ({detail})" for what, ok, detail in checks]
  return "\n".join(lines)


def _lengths(text: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    values = []
  if len(values) < 2 or any(v < 2 for v in values) or values != sorted(set(values)):
    raise ValueError(
        f"--lengths={text!r}: give two or more increasing context lengths >= 2, "
        "comma-separated (e.g. 1024,4096,16384,65536)."
    )
  return values


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks decode", description=__doc__.split("\n\n")[0]
  )
  parser.add_argument("--lengths", default="1024,4096,16384,65536")
  parser.add_argument("--steps", type=int, default=64, help="tokens decoded per timed run")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--out", default="", help="folder for decode.md / decode.json")
  args = parser.parse_args(argv)
  try:
    lengths = _lengths(args.lengths)
    for name in ("steps", "repeats", "width", "layers", "heads"):
      if getattr(args, name) < 1:
        raise ValueError(f"--{name}={getattr(args, name)}: must be >= 1.")
    if args.steps + 1 >= lengths[0]:
      raise ValueError(
          f"--steps={args.steps} must be below the shortest length - 1 " f"({lengths[0] - 1})."
      )
  except ValueError as e:
    print(f"benchmarks.decode: {e}", file=sys.stderr)
    return 2
  results = {}
  for name, (kernel, scheme) in CELLS.items():
    results[name] = {}
    for n in lengths:
      r = measure(
          kernel,
          scheme,
          n,
          steps=args.steps,
          repeats=args.repeats,
          width=args.width,
          layers=args.layers,
          heads=args.heads,
      )
      results[name][n] = r
      print(
          f"{name} n={n}: {r['ms_per_token']:.3f} ms/token, {r['tokens_per_s']:.0f} tokens/s, "
          f"state {_size(r['state_bytes'])}",
          flush=True,
      )
  checks = verdicts(results, lengths)
  command = report.command("decode", argv)
  table = markdown(results, lengths, checks, command.strip())
  print(table)
  report.write(
      args.out,
      "decode",
      table,
      {
          "results": {k: {str(n): r for n, r in v.items()} for k, v in results.items()},
          "checks": [{"target": t, "pass": ok, "detail": d} for t, ok, d in checks],
          "args": vars(args),
      },
  )
  return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
  sys.exit(main())
