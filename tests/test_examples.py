"""Every script in examples/ runs on tiny sizes and passes its own assertions (each asserts its
result: accuracy reached, padding and causality, decoding equal to the full forward, a
registered scheme equal to its hand-written form)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import FAST_COMPILE_FLAGS

# The three run one after another on one xdist worker, dealt before the single tests
# (tests/conftest.py): the run does not end waiting for one of them.
pytestmark = pytest.mark.xdist_group("examples")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
FAST_COMPILE = FAST_COMPILE_FLAGS


def _run(script: str, *args: str) -> str:
  out = subprocess.run(
      [sys.executable, os.path.join(EXAMPLES, script), *args],
      capture_output=True,
      text=True,
      cwd=ROOT,
      env={
          **os.environ,
          "PYTHONPATH": ROOT,  # this checkout's fastpos, not an installed one
          # Compiling is most of an example's time: XLA's CPU backend compiles these tiny programs
          # about a quarter faster without its LLVM optimisations (the checks allow round-off).
          "XLA_FLAGS": FAST_COMPILE,
      },
      timeout=600,
  )
  assert out.returncode == 0, f"{script} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
  return out.stdout


def test_every_example_is_tested():
  scripts = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))
  with open(__file__, encoding="utf-8") as f:
    source = f.read()
  assert scripts and all(f'"{s}"' in source for s in scripts), scripts


# Slow; the default run keeps the cheapest example, test_custom_scheme.
@pytest.mark.slow
def test_own_model():
  out = _run("own_model.py", "--steps=80", "--min_accuracy=0.9")
  assert "bidirectional elu1 + rope+fastrpb: copy accuracy" in out
  assert "causality: largest gradient from a later input 0.00e+00" in out


def test_custom_scheme():
  out = _run("custom_scheme.py", "--width=16", "--heads=2", "--length=12")
  assert "alibi layer vs ALiBi by hand (float64)" in out
  assert "decoded vs full forward" in out


# Slow; the default run keeps the cheapest example, test_custom_scheme.
@pytest.mark.slow
def test_load_and_sample():  # ~20 s of CPU (a tiny train.py run)
  out = _run("load_and_sample.py", "--steps=4", "--num_tokens=6")
  assert "text_lm: DecoderLM, kernel elu1, positional rope" in out
  sample = next(line for line in out.splitlines() if line.startswith("the -> "))
  assert len(sample.split(" -> ")[1].split()) == 6
