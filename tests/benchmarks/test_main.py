"""``python -m benchmarks``: the list of benchmarks, one line for an unknown name, a
benchmark's flags handed to its module; every listed name is a module with a ``main``."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from benchmarks import BENCHMARKS
from benchmarks import __main__ as cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args):
  return subprocess.run(
      [sys.executable, "-m", "benchmarks", *args],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=120,
  )


def test_it_lists_the_benchmarks_and_hands_flags_to_one(capsys):
  # context_parallel sets the host device count before JAX starts: a fresh process, which also
  # holds the command end to end (one line, exit 2, no traceback).
  run = _cli("context_parallel", "--cells=nope")
  assert run.returncode == 2 and "unknown cell 'nope'" in run.stderr
  assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr
  # The rest through the same main, in this process.
  assert cli.main(["--help"]) == 0
  listing = capsys.readouterr().out
  for name, text in BENCHMARKS.items():
    assert f"  {name} " in listing and text in listing
  assert cli.main([]) == 2 and "speed" in capsys.readouterr().err
  assert cli.main(["nope", "--out=x"]) == 2
  err = capsys.readouterr().err
  assert err == (
      f"python -m benchmarks: unknown benchmark 'nope'; choose one of: {', '.join(BENCHMARKS)}.\n"
  )
  assert cli.main(["decode", "--lengths=1024,x"]) == 2  # decode's own flag, checked by decode
  assert capsys.readouterr().err.startswith("benchmarks.decode: ")
  with pytest.raises(SystemExit) as e:
    cli.main(["speed", "--mode=decode"])
  assert e.value.code == 2 and "invalid choice: 'decode'" in capsys.readouterr().err


def test_every_benchmark_is_a_module_with_a_main():
  for name in BENCHMARKS:
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(module.main), name
    assert module.__doc__, name
