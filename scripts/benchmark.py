"""fastpos benchmarks: one command, ``--mode`` picks what is measured.

  ops, layer, train_step, all   speed and memory against sequence length
                                (fastpos.bench.harness; its flags: --mode=ops --help)
  decode                        tokens/s and decoding-state memory against context length
                                (fastpos.bench.decode)
  context_parallel              train-step memory per device with the sequence split over
                                devices, and the longest N a budget fits (compiles only;
                                fastpos.bench.context_parallel)
  memory                        train-step memory against model.remat / model.scan_layers,
                                the longest N a budget fits, compile time against depth
                                (compiles only; fastpos.bench.memory)

  python scripts/benchmark.py --mode=all --out=/tmp/bench
  python scripts/benchmark.py --mode=decode --lengths=1024,4096 --out=benchmarks
  python scripts/benchmark.py --mode=context_parallel --lengths=16384,65536

The flags after ``--mode`` are the mode's own (``--mode=decode --help`` lists them). Exit
codes are the mode's: 0 done (and every target passed, where the mode has targets), 1 a
target failed, 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import sys

SPEED_MODES = ("ops", "layer", "train_step", "all")
OTHER_MODES = ("decode", "context_parallel", "memory")


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(
      prog="python scripts/benchmark.py",
      add_help=False,
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=__doc__.split("\n\n", 1)[1],
  )
  parser.add_argument("--mode", choices=SPEED_MODES + OTHER_MODES)
  known, rest = parser.parse_known_args(argv)
  if known.mode is None:
    if "-h" in argv or "--help" in argv:
      parser.print_help()
      return 0
    parser.print_usage(sys.stderr)
    print(
        f"benchmark: give --mode, one of {', '.join(SPEED_MODES + OTHER_MODES)}.", file=sys.stderr
    )
    return 2
  if known.mode == "decode":
    from fastpos.bench import decode

    return decode.main(rest)
  if known.mode == "context_parallel":
    from fastpos.bench import context_parallel  # sets the host device count before JAX starts

    return context_parallel.main(rest)
  if known.mode == "memory":
    from fastpos.bench import memory

    return memory.main(rest)
  from fastpos.bench import harness

  return harness.main(argv)


if __name__ == "__main__":
  sys.exit(main())
