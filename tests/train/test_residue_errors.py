"""Inputs that used to end in a traceback or in the wrong words, as programs and as library
calls: each gives one line naming the file or value and the fix (exit 2), or the right result.

* ``launches.jsonl`` with a line that is JSON but not an object, or a line cut off: the file
  and line number (train.py resuming, eval.py).
* A step folder renamed to another step: named at the start, with how to fix it (not a
  ``StepAlreadyExistsError`` many steps later).
* A FIFO or ``/dev/zero`` as ``config.task.paths``: "is not a regular file".
* ``optimizer.learning_rate=1e308``: the range check names the valid range.
* ``generate.py --temperature=1e38``: the range check; the sampler itself, at temperatures up
  to float32's largest, never draws the padding id and draws every other one.

The program cases run in one driver (tests/train/forked.py), after a 2-step training run that
the cases copy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from fastpos.api import generation
from fastpos.tasks import paths as paths_lib
from fastpos.train import errors, launches
from fastpos.train import workdir as workdir_lib
from fastpos.train.errors import RunError
from tests.helpers import FAST_COMPILE_FLAGS
from tests.train import forked

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [
    "--config=configs/synthetic.py:tiny",
    "--config.num_train_steps=2",
    "--config.eval_every_steps=2",
    "--config.checkpoint_every_steps=1",
    "--config.log_every_steps=1",
]
# Run in the driver as a script (argv: the trained workdir, the folder of the cases): the
# workdirs and files the cases read.
PREPARE = r"""
import os, pathlib, shutil, sys
base, root = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for name in ("not_an_object", "cut_off", "renamed"):
  shutil.copytree(base, root / name)
with open(root / "not_an_object" / "launches.jsonl", "a") as f:
  f.write("[1, 2]\n")
with open(root / "cut_off" / "launches.jsonl", "a") as f:
  f.write('{"first_step": 3, "comma')
(root / "renamed" / "checkpoints" / "2").rename(root / "renamed" / "checkpoints" / "9")
os.mkfifo(root / "fifo.txt")
"""


def _commands(tmp: Path) -> dict[str, tuple[forked.Command, tuple[str, ...]]]:
  """{case: (command, what its one line must hold)}; "trained" and "prepare" first."""
  base = tmp / "trained"
  text_lm = ["--config=configs/text_lm.py:tiny", f"--workdir={tmp / 'text_lm'}"]
  return {
      "trained": (forked.Command("train.py", [*TRAIN, f"--workdir={base}"]), ()),
      "prepare": (forked.Command("-", [base, tmp]), ()),
      "eval-not-an-object": (
          forked.Command("eval.py", [f"--workdir={tmp / 'not_an_object'}"]),
          ("not_an_object/launches.jsonl:2 is a JSON list, not a launch record", "delete it"),
      ),
      "resume-cut-off": (
          forked.Command("train.py", [*TRAIN, f"--workdir={tmp / 'cut_off'}"]),
          ("cut_off/launches.jsonl:2 is not JSON (cut off: its write was interrupted)",),
      ),
      "resume-renamed": (
          forked.Command("train.py", [*TRAIN, f"--workdir={tmp / 'renamed'}"]),
          (
              "renamed/checkpoints/9 holds the checkpoint of step 2, not 9: the folder was "
              "renamed. Rename it back to ",
              "renamed/checkpoints/2",
          ),
      ),
      "paths-fifo": (
          forked.Command("train.py", [*text_lm, f"--config.task.paths={tmp / 'fifo.txt'}"]),
          ("fifo.txt' (config.task.paths) is not a regular file (a named pipe (FIFO))",),
      ),
      "paths-dev-zero": (
          forked.Command("train.py", [*text_lm, "--config.task.paths=/dev/zero"]),
          ("'/dev/zero' (config.task.paths) is not a regular file (a character device)",),
      ),
      "learning-rate": (
          forked.Command(
              "train.py", [*TRAIN, "--config.optimizer.learning_rate=1e308", f"--workdir={tmp}/lr"]
          ),
          ("config.optimizer.learning_rate must be a finite number in (0, 10]; got 1e+308",),
      ),
      "temperature": (
          forked.Command(
              "scripts/generate.py",
              [f"--workdir={tmp}/none", "--prompt=1 2", "--temperature=1e38"],
          ),
          ("--temperature", "1e+38"),
      ),
  }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("residue")
  commands = _commands(tmp)
  script = tmp / "prepare.py"
  script.write_text(PREPARE)
  commands["prepare"] = (forked.Command(str(script), commands["prepare"][0].args), ())
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_COMPILE_FLAGS}
  out = forked.run_all([c for c, _ in commands.values()], tmp / "outputs", env)
  return {name: (r, needles) for (name, (_, needles)), r in zip(commands.items(), out)}


def test_the_run_the_cases_copy_trained(results):
  for name in ("trained", "prepare"):
    result, _ = results[name]
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize(
    "name",
    [
        "eval-not-an-object",
        "resume-cut-off",
        "resume-renamed",
        "paths-fifo",
        "paths-dev-zero",
        "learning-rate",
        "temperature",
    ],
)
def test_one_line_naming_the_file_or_value(results, name):
  result, needles = results[name]
  out = result.stdout + result.stderr
  assert "Traceback" not in out, out[-4000:]
  assert result.returncode == errors.EXIT_BAD_INPUT, out[-4000:]
  prog = "generate.py" if name == "temperature" else name.split("-")[0] + ".py"
  prog = "train.py" if prog not in ("eval.py", "generate.py") else prog
  (line,) = [x for x in result.stderr.splitlines() if x.startswith(f"{prog}: ")]
  assert result.stderr.strip().splitlines()[-1] == line, result.stderr[-3000:]
  for needle in needles:
    assert needle in line, (needle, line)


# ---------------------------------------------------------------------------------------------
# The same checks as library calls
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tail, needle",
    [
        ("[1, 2]\n", "launches.jsonl:2 is a JSON list, not a launch record"),
        ('"text"\n{}\n', "launches.jsonl:2 is a JSON str"),
        ('{"first_step": 3, "co', "launches.jsonl:2 is not JSON (cut off"),
        ('{"first_step": 3\n{}\n', "launches.jsonl:2 is not JSON: Expecting ',' delimiter"),
        (b"{\xe9}\n", "launches.jsonl:2 is not JSON"),
    ],
)
def test_launches_read_names_the_bad_line(tmp_path, tail, needle):
  path = tmp_path / workdir_lib.LAUNCHES_NAME
  head = json.dumps({"first_step": 1}) + "\n"
  path.write_bytes(head.encode() + (tail if isinstance(tail, bytes) else tail.encode()))
  with pytest.raises(RunError, match="fix that line or delete it") as e:
    launches.read(tmp_path)
  assert str(path) + needle.removeprefix("launches.jsonl") in str(e.value)


def test_special_files_are_named(tmp_path):
  fifo = tmp_path / "pipe"
  os.mkfifo(fifo)
  assert paths_lib.special_file(fifo) == "a named pipe (FIFO)"
  assert paths_lib.special_file("/dev/zero") == "a character device"
  assert paths_lib.special_file(tmp_path) == "" and paths_lib.special_file(tmp_path / "x") == ""
  (tmp_path / "f.txt").write_text("text\n")
  assert paths_lib.special_file(tmp_path / "f.txt") == ""


@pytest.mark.parametrize("temperature", [1.0, generation.MAX_TEMPERATURE, 1e38, 3.4e38])
def test_the_sampler_never_draws_padding(temperature):
  """Up to float32's largest temperature: never id 0; at the extreme ones every other id
  comes up (uniform over 1..V-1: 40 draws of 8 ids miss one with probability < 1e-2)."""
  logits = jax.random.normal(jax.random.key(0), (40, 8)) * 3
  ids = np.asarray(
      generation.sample_logits(logits, jax.random.key(1), temperature=temperature, top_k=0, top_p=1)
  )
  assert ids.min() >= 1, ids
  if temperature >= generation.MAX_TEMPERATURE:
    assert set(ids.tolist()) == set(range(1, 8)), ids


def test_generate_refuses_a_temperature_out_of_range():
  with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0 and <= 1e\+06"):
    generation.check_sampling(4, 1e38, 0, 1.0, vocab_size=10)
