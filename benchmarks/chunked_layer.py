"""One attention layer by chunks (``model.attn_chunk``) against the whole layer.

``python -m benchmarks chunked_layer --out benchmarks`` compiles the fwd+bwd of one
attention layer (its output, and the grads of its parameters and input) with
``attn_chunk = 0`` and ``attn_chunk = --chunk``, causal and bidirectional, for sikf, ELU+1 and
sikf + FastRPB (an output-hook scheme: its ``W V`` over the whole ``v`` is not chunked), and
reports for each pair the compiled temporary memory (``memory_analysis``) and the fwd+bwd
time, the rows of one length timed interleaved in one group (``ops_lean._timed_group``).
float32, batch 1, width 256, 4 heads of 64 (the LRA Text model's attention).

Goals, for the layers without output-hook schemes: the chunked layer's temporary memory at
most half the whole layer's, its time at most 1.25x. Writes ``<out>/chunked_layer.md`` and
``.json``.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import measure as bm
from benchmarks import ops_lean, report
from fastpos.models.attention import Attention, AttentionConfig, KernelSpec, PositionalSpec

WIDTH, HEADS = 256, 4
# (label, kernel, schemes): the layers measured; "hooks" marks the one an output hook mixes.
LAYERS = (("sikf", "sikf", ()), ("ELU+1", "elu1", ()), ("sikf + FastRPB", "sikf", ("fastrpb",)))
MEMORY_GOAL, TIME_GOAL = 0.5, 1.25


def _layer(kernel: str, schemes, causal: bool, n: int, chunk: int) -> Attention:
  cfg = AttentionConfig(
      num_heads=HEADS,
      head_dim=WIDTH // HEADS,
      embed_dim=WIDTH,
      kernel=KernelSpec(kernel),
      positional=tuple(PositionalSpec.make(s) for s in schemes),
      max_length=n,
      causal=causal,
      attn_chunk=chunk,
  )
  return Attention(cfg, dtype=jnp.float32)


def _case(key: str, layer: Attention, params, n: int) -> bm.Case:
  """fwd+bwd of ``layer`` at length n: its output and the grads of params and x."""

  def fn(p, x, ct):
    out, vjp = jax.vjp(lambda p, x: layer.apply(p, x), p, x)
    return out, vjp(ct)

  make = lambda: (
      params,
      bm.pseudo_normal(0, (1, n, WIDTH)),
      bm.pseudo_normal(1, (1, n, WIDTH)),
  )
  return bm.Case(key, fn, make)


def measure(n: int, chunk: int, rounds: int, log) -> list[dict]:
  """For each (layer, causal): the whole and chunked layer's temp MiB and median ms."""
  cases, pairs = [], []
  for label, kernel, schemes in LAYERS:
    for causal in (False, True):
      whole = _layer(kernel, schemes, causal, n, 0)
      params = whole.init(jax.random.key(0), jnp.zeros((1, 64, WIDTH)))  # shapes need no N
      keys = [
          f"{label}, {'causal' if causal else 'bidirectional'}, attn_chunk={c}" for c in (0, chunk)
      ]
      for key, c in zip(keys, (0, chunk)):
        cases.append(_case(key, _layer(kernel, schemes, causal, n, c), params, n))
      pairs.append({"layer": label, "causal": causal, "hooks": bool(schemes), "keys": keys})
  wall, _, temp = ops_lean._timed_group(cases, rounds)
  rows = []
  for pr in pairs:
    whole, chunked = pr.pop("keys")
    row = {
        **pr,
        "whole_temp_mib": temp[whole] / 2**20,
        "chunked_temp_mib": temp[chunked] / 2**20,
        "whole_ms": 1e3 * float(np.median(wall[whole])),
        "chunked_ms": 1e3 * float(np.median(wall[chunked])),
        "time_ratios": [c / w for c, w in zip(wall[chunked], wall[whole])],
    }
    row["memory_ratio"] = row["chunked_temp_mib"] / row["whole_temp_mib"]
    row["time_ratio"] = row["chunked_ms"] / row["whole_ms"]
    rows.append(row)
    log(
        f"{pr['layer']}, causal={pr['causal']}: temp {row['whole_temp_mib']:.1f} -> "
        f"{row['chunked_temp_mib']:.1f} MiB ({row['memory_ratio']:.2f}x), time "
        f"{row['time_ratio']:.2f}x"
    )
  return rows


def goals(rows: list[dict], n: int) -> list[dict]:
  out = []
  for r in rows:
    if r["hooks"]:
      continue
    what = f"{r['layer']} {'causal' if r['causal'] else 'bidirectional'} at N={n}"
    out.append(
        {
            "goal": f"{what}: chunked temp memory <= {MEMORY_GOAL}x the whole layer's",
            "measured": f"{r['memory_ratio']:.2f}x",
            "pass": r["memory_ratio"] <= MEMORY_GOAL,
        }
    )
    out.append(
        {
            "goal": f"{what}: chunked fwd+bwd time <= {TIME_GOAL}x the whole layer's",
            "measured": f"{r['time_ratio']:.2f}x",
            "pass": r["time_ratio"] <= TIME_GOAL,
        }
    )
  return out


def markdown(record: dict) -> str:
  run = record["run"]
  lines = [
      "# One attention layer by chunks (`model.attn_chunk`) against the whole layer",
      "",
      f"{report.provenance(run)}. float32, batch 1, width {WIDTH}, {HEADS} heads, N = "
      f"{record['length']}, chunk {record['chunk']}; fwd+bwd: the output and the grads of the "
      "parameters and the input. Temp: `memory_analysis().temp_size_in_bytes` of the compiled "
      "fwd+bwd. Time: medians of interleaved runs in one group; the ratio is the chunked "
      "median over the whole one (each round's ratio in the JSON). sikf + FastRPB keeps "
      "FastRPB's `W V` over the whole `v` (an output hook, not chunked), so its memory is "
      "reported without a goal.",
      "",
      *report.goals_table(record["goals"]),
      "",
      "| layer | causal | temp MiB whole | temp MiB chunked | memory ratio | ms whole | "
      "ms chunked | time ratio |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for r in record["rows"]:
    lines.append(
        f"| {r['layer']} | {r['causal']} | {r['whole_temp_mib']:.1f} | "
        f"{r['chunked_temp_mib']:.1f} | {r['memory_ratio']:.2f}x | {r['whole_ms']:.0f} | "
        f"{r['chunked_ms']:.0f} | {r['time_ratio']:.2f}x |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--length", type=int, default=16384)
  p.add_argument("--chunk", type=int, default=1024)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--out", default=None, help="folder for chunked_layer.md / .json")
  args = p.parse_args(argv)
  for name in ("length", "chunk", "rounds"):
    if getattr(args, name) < 1:
      print(f"--{name} must be an int >= 1; got {getattr(args, name)}", file=sys.stderr)
      return 2
  if args.chunk >= args.length:
    print(
        f"--chunk must be below --length (the layer runs by chunks only with more than one); "
        f"got {args.chunk} and {args.length}",
        file=sys.stderr,
    )
    return 2
  run = report.run_record("chunked_layer", argv)
  rows = measure(args.length, args.chunk, args.rounds, lambda s: print(s, flush=True))
  record = {"run": run, "length": args.length, "chunk": args.chunk, "rows": rows}
  record["goals"] = goals(rows, args.length)
  table = markdown(record)
  print(table)
  report.write(args.out, "chunked_layer", table, record)
  return 0


if __name__ == "__main__":
  sys.exit(main())
