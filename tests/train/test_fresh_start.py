"""Nothing is deleted: a start from scratch in a workdir holding another run's records (no
checkpoint) is refused naming them; --fresh moves them, byte for byte, to previous/<time>/; a
resume whose record file is missing or damaged is refused naming it, never recreated."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastpos.train import identity, launches, train_and_evaluate
from fastpos.train import workdir as workdir_lib
from fastpos.train.errors import EXIT_BAD_INPUT, RunError
from tests.train.common import tiny_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A 2-step run of the tiny config, resumed once with a recorded change (every record file)."""
  workdir = tmp_path_factory.mktemp("fresh") / "run"
  train_and_evaluate(tiny_config(num_train_steps=2), workdir)
  train_and_evaluate(tiny_config(num_train_steps=4, log_every_steps=2), workdir)
  return workdir


def _copy(src: Path, tmp_path: Path) -> Path:
  out = tmp_path / "run"
  shutil.copytree(src, out)
  return out


def _files(path: Path) -> dict[str, str]:
  """{relative path: SHA-256} of every file under ``path``."""
  return {
      str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
      for p in sorted(path.rglob("*"))
      if p.is_file() and p.name != "train.lock"
  }


def test_a_start_over_another_runs_records_is_refused_then_moved_with_fresh(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  shutil.rmtree(workdir / "checkpoints")  # best/, metrics, TensorBoard, config.json kept
  before = _files(workdir)
  with pytest.raises(RunError) as info:
    train_and_evaluate(tiny_config(num_train_steps=2, seed=5), workdir)
  line = str(info.value)
  assert "\n" not in line and line.startswith(f"{workdir} holds the records of another run (")
  for name in ("config.json", "metrics.jsonl", "best", "tensorboard", "run.json"):
    assert name in line
  assert "--fresh" in line
  assert _files(workdir) == before
  train_and_evaluate(tiny_config(num_train_steps=2, seed=5), workdir, fresh=True)
  (moved,) = (workdir / workdir_lib.PREVIOUS_DIR).iterdir()
  assert _files(moved) == before  # every file, byte for byte
  (line,) = launches.read(workdir)  # the new run's own records
  assert line["first_step"] == 1
  assert identity.read_start(workdir)["id"] != identity.read_start(moved)["id"]
  # --fresh over a workdir with checkpoints moves them too; a second move gets its own folder.
  again = _files(workdir)
  train_and_evaluate(tiny_config(num_train_steps=2, seed=6), workdir, fresh=True)
  folders = sorted((workdir / workdir_lib.PREVIOUS_DIR).iterdir())
  assert len(folders) == 2
  newer = next(f for f in folders if f != moved)
  assert _files(newer) == {k: v for k, v in again.items() if not k.startswith("previous/")}


@pytest.mark.parametrize(
    "name",
    [
        "metrics.jsonl",
        workdir_lib.LAUNCHES_NAME,
        workdir_lib.CONFIG_NAME,
        workdir_lib.CHANGES_NAME,
        workdir_lib.RUN_NAME,
    ],
)
def test_a_missing_record_file_is_named(trained, tmp_path, name):
  workdir = _copy(trained, tmp_path)
  (workdir / name).unlink()
  before = _files(workdir)
  with pytest.raises(RunError) as info:
    train_and_evaluate(tiny_config(num_train_steps=6, log_every_steps=2), workdir)
  line = str(info.value)
  assert "\n" not in line and f"{workdir / name}" in line and "missing" in line, line
  assert _files(workdir) == before


@pytest.mark.parametrize("name", ["metrics.jsonl", workdir_lib.LAUNCHES_NAME, workdir_lib.RUN_NAME])
def test_a_damaged_record_file_is_named(trained, tmp_path, name):
  workdir = _copy(trained, tmp_path)
  path = workdir / name
  path.write_bytes(b"{torn\n" + path.read_bytes())
  before = _files(workdir)
  with pytest.raises(RunError, match=rf"{path}(:1)? is not"):
    train_and_evaluate(tiny_config(num_train_steps=6, log_every_steps=2), workdir)
  assert _files(workdir) == before


@pytest.mark.slow
def test_train_py_fresh(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  shutil.rmtree(workdir / "checkpoints")
  config = f"--config={workdir / 'config.json'}"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = lambda *a: subprocess.run(  # noqa: E731
      [sys.executable, "train.py", config, f"--workdir={workdir}", *a],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  proc = run()
  assert proc.returncode == EXIT_BAD_INPUT and "Traceback" not in proc.stderr
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith(f"train.py: {workdir} holds the records of another run")
  before = _files(workdir)
  proc = run("--fresh")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "--fresh: moved the earlier run's files" in proc.stderr
  (moved,) = (workdir / workdir_lib.PREVIOUS_DIR).iterdir()
  assert _files(moved) == before
