"""Causal linear attention by algorithm: the serial scan ("recurrent") against the
chunkwise-parallel form ("chunk"), fwd+bwd, side by side.

``python -m benchmarks modes --out benchmarks`` compiles for each length the fwd+bwd (the
output and the grads of phi_q, phi_k, v) of ``linear_attention(causal=True, mode=...)`` in
both modes, and the bidirectional op as the yardstick, then times them interleaved in one
group per length (``ops_lean._timed_group``: ``--rounds`` round-robin rounds, medians).
float32, batch 1, 8 heads, m = d = 64, positive features. Prints and writes
``<out>/modes_<backend>.md`` and ``.json``; with ``--update_auto`` it also rewrites this
backend's entry of ``fastpos.ops.linear_attn.auto.TABLE``: "chunk" when it is at least as
fast as "recurrent" at every length measured, else "recurrent" (auto never makes a backend
slower than the serial scan it had).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import measure as bm
from benchmarks import ops_lean, report
from fastpos.ops import attention
from fastpos.ops.linear_attn import auto

HEADS, M, D = 8, 64, 64
LENGTHS = (1024, 2048, 4096, 8192, 16384)
ROWS = ("recurrent", "chunk", "bidirectional")


def _case(key: str, n: int) -> bm.Case:
  causal = key != "bidirectional"
  mode = "auto" if not causal else key

  def fn(pq, pk, v, ct):
    op = lambda a, b, c: attention.linear_attention(a, b, c, causal=causal, mode=mode)
    out, vjp = jax.vjp(op, pq, pk, v)
    return out, vjp(ct)

  make = lambda: (
      jnp.exp(0.5 * bm.pseudo_normal(0, (1, n, HEADS, M))),
      jnp.exp(0.5 * bm.pseudo_normal(1, (1, n, HEADS, M))),
      bm.pseudo_normal(2, (1, n, HEADS, D)),
      bm.pseudo_normal(3, (1, n, HEADS, D)),
  )
  return bm.Case(f"{key}, N={n}", fn, make)


def measure(lengths, rounds: int, log) -> list[dict]:
  """Per length: each row's median fwd+bwd ms and the ratios, each round's ratio kept."""
  rows = []
  for n in lengths:
    cases = [_case(k, n) for k in ROWS]
    wall, _, temp = ops_lean._timed_group(cases, rounds)
    t = {k: wall[f"{k}, N={n}"] for k in ROWS}
    med = {k: 1e3 * float(np.median(v)) for k, v in t.items()}
    row = {
        "length": n,
        "ms": med,
        "temp_mib": {k: temp[f"{k}, N={n}"] / 2**20 for k in ROWS},
        "chunk_over_recurrent": med["chunk"] / med["recurrent"],
        "rounds_chunk_over_recurrent": [c / r for c, r in zip(t["chunk"], t["recurrent"])],
        "recurrent_over_bidirectional": med["recurrent"] / med["bidirectional"],
        "chunk_over_bidirectional": med["chunk"] / med["bidirectional"],
    }
    log(
        f"N={n}: recurrent {med['recurrent']:.1f} ms, chunk {med['chunk']:.1f} ms "
        f"({row['chunk_over_recurrent']:.2f}x), bidirectional {med['bidirectional']:.1f} ms"
    )
    rows.append(row)
  return rows


def choice(rows: list[dict]) -> str:
  """ "chunk" when it is at least as fast as "recurrent" at every length, else "recurrent"."""
  return "chunk" if all(r["chunk_over_recurrent"] <= 1.0 for r in rows) else "recurrent"


def markdown(record: dict) -> str:
  lines = [
      f"# Causal linear attention by algorithm ({record['backend']})",
      "",
      f"{report.provenance(record['run'])}. float32, batch 1, {HEADS} heads, m = {M}, "
      f"d = {D}; fwd+bwd (the output and the grads of phi_q, phi_k, v). Medians of "
      f"{record['rounds']} interleaved rounds per length; each round's chunk / recurrent "
      f'ratio in the JSON. Temp: `memory_analysis().temp_size_in_bytes`. `mode="auto"` '
      f"on this backend: **{record['auto']}** (chunk only where it is at least as fast at "
      "every length).",
      "",
      "| N | recurrent ms | chunk ms | chunk / recurrent | bidirectional ms | "
      "recurrent / bidir. | chunk / bidir. | temp MiB recurrent | temp MiB chunk |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in record["rows"]:
    ms, mib = r["ms"], r["temp_mib"]
    lines.append(
        f"| {r['length']} | {ms['recurrent']:.1f} | {ms['chunk']:.1f} | "
        f"{r['chunk_over_recurrent']:.2f}x | {ms['bidirectional']:.1f} | "
        f"{r['recurrent_over_bidirectional']:.2f}x | {r['chunk_over_bidirectional']:.2f}x | "
        f"{mib['recurrent']:.0f} | {mib['chunk']:.0f} |"
    )
  return "\n".join(lines)


def _source_lines(text: str, width: int = 80) -> list[str]:
  words, lines, line = text.split(" "), [], ""
  for w in words:
    if line and len(line) + len(w) + 1 > width:
      lines.append(line + " ")
      line = w
    else:
      line = f"{line} {w}" if line else w
  return lines + [line]


def table_source(table: dict) -> str:
  """``auto.TABLE`` as the Python text between its markers (the house format)."""
  out = ["TABLE = {"]
  for backend, entry in table.items():
    out += [f'    "{backend}": {{', f'        "mode": "{entry["mode"]}",', '        "source": (']
    out += [f"            {json.dumps(s)}" for s in _source_lines(entry["source"])]
    out += ["        ),", "    },"]
  return "\n".join(out + ["}"])


def update_auto(backend: str, mode: str, source: str, path: str | None = None) -> dict:
  """Rewrites ``backend``'s entry of ``auto.TABLE`` in the file ``path`` (``auto.py`` when
  None), between its markers; returns the table written (the imported module is unchanged)."""
  path = auto.__file__ if path is None else path
  with open(path, encoding="utf-8") as f:
    text = f.read()
  table = {k: dict(v) for k, v in auto.TABLE.items()}
  table[backend] = {"mode": mode, "source": source}
  block = re.compile(r"(# BEGIN TABLE[^\n]*\n).*?(\n# END TABLE)", re.S)
  if not block.search(text):
    raise ValueError(f"{path} has no '# BEGIN TABLE' / '# END TABLE' block to rewrite.")
  text = block.sub(lambda m: m.group(1) + table_source(table) + m.group(2), text)
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  return table


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--out", default="benchmarks", help="folder for modes_<backend>.md / .json")
  p.add_argument(
      "--update_auto",
      action="store_true",
      help="rewrite this backend's entry of fastpos/ops/linear_attn/auto.py",
  )
  args = p.parse_args(argv)
  try:
    lengths = [int(x) for x in args.lengths.split(",")]
  except ValueError:
    lengths = []
  if not lengths or min(lengths) < 1:
    print(f"--lengths must be ints >= 1 joined by ','; got {args.lengths!r}", file=sys.stderr)
    return 2
  if args.rounds < 1:
    print(f"--rounds must be an int >= 1; got {args.rounds}", file=sys.stderr)
    return 2
  backend = jax.default_backend()
  run = report.run_record("modes", argv)
  rows = measure(lengths, args.rounds, lambda s: print(s, flush=True))
  record = {"run": run, "backend": backend, "rounds": args.rounds, "rows": rows}
  record["auto"] = choice(rows)
  table = markdown(record)
  print(table)
  name = f"modes_{backend}"
  report.write(args.out, name, table, record)
  if args.update_auto:
    ratios = ", ".join(f"{r['chunk_over_recurrent']:.2f}x" for r in rows)
    source = (
        f"benchmarks.modes on {run['machine']}, {run['date']}: chunk / recurrent fwd+bwd "
        f"{ratios} at N = {', '.join(str(n) for n in lengths)} "
        f"({os.path.join(args.out, name)}.md)"
    )
    table = update_auto(backend, record["auto"], source)
    print(f"auto.TABLE[{backend!r}] = {table[backend]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
