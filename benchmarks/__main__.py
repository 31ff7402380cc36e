"""``python -m benchmarks NAME [flags]``: runs one benchmark; without a name (or with
``--help``) lists them. The exit code is the benchmark's (0 done and every goal passed, where
it has goals; 1 a goal failed; 2 bad input, in one line); an unknown name exits 2.
"""

from __future__ import annotations

import importlib
import sys

from benchmarks import BENCHMARKS

PROG = "python -m benchmarks"


def usage() -> str:
  width = max(len(name) for name in BENCHMARKS)
  lines = [f"usage: {PROG} NAME [flags]   ({PROG} NAME --help: its flags)", "", "benchmarks:"]
  lines += [f"  {name:<{width}}  {text}" for name, text in BENCHMARKS.items()]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(usage(), file=sys.stdout if argv else sys.stderr)
    return 0 if argv else 2
  name, rest = argv[0], argv[1:]
  if name not in BENCHMARKS:
    print(
        f"{PROG}: unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}.",
        file=sys.stderr,
    )
    return 2
  # Imported only now: context_parallel and million set the host device count before JAX starts.
  module = importlib.import_module(f"benchmarks.{name}")
  return module.main(rest)


if __name__ == "__main__":
  sys.exit(main())
