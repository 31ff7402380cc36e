"""A full disk under each file a run writes: ``config.json``, ``config_changes.jsonl``,
``launches.jsonl``, the TensorBoard events, ``train.log``, ``metrics.jsonl`` and the
checkpoints. Every write to the chosen file goes to ``/dev/full`` (each write fails with
ENOSPC, as on a full disk, where the error names no file); the run must stop with one line
that names the file and the fix, with the exit code of a bad workdir (``EXIT_BAD_INPUT``), and
without a traceback, in the main thread or a background one, and without hanging."""

from __future__ import annotations

import builtins
import contextlib
import errno
import fnmatch
import io
import logging
import os
from pathlib import Path

import orbax.checkpoint as ocp
import pytest
from absl import logging as absl_logging

from fastpos.train import errors, program, train_and_evaluate
from fastpos.train import workdir as workdir_lib
from tests.train.common import tiny_config

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


@contextlib.contextmanager
def _full_disk_under(pattern: str):
  """While entered, a file whose name matches ``pattern`` opened for writing is /dev/full."""
  real_open = io.open

  def full_open(file, mode="r", *args, **kwargs):
    name = os.path.basename(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else ""
    if name and any(m in mode for m in "wax+") and fnmatch.fnmatch(name, pattern):
      return real_open("/dev/full", mode.replace("x", "w"), *args, **kwargs)
    return real_open(file, mode, *args, **kwargs)

  patches = [(io, "open"), (builtins, "open")]  # logging.FileHandler looks open up per handler
  saved = [getattr(o, n) for o, n in patches]
  for owner, name in patches:
    setattr(owner, name, full_open)
  try:
    yield
  finally:
    for (owner, name), value in zip(patches, saved):
      setattr(owner, name, value)


def _stop(workdir: Path, pattern: str, caplog, capfd, **overrides) -> str:
  """The one line of a run that finds the disk full under ``pattern``; checks its code."""
  verbosity, level = absl_logging.get_verbosity(), logging.getLogger("absl").level
  absl_logging.set_verbosity(absl_logging.INFO)  # as train.py runs: train.log gets records
  try:
    with (
        caplog.at_level(logging.WARNING),
        _full_disk_under(pattern),
        pytest.raises(Exception) as info,
    ):
      train_and_evaluate(tiny_config(**{"num_train_steps": 2, **overrides}), workdir, **_ALLOW)
  finally:
    absl_logging.set_verbosity(verbosity)
    logging.getLogger("absl").setLevel(level)
  e = info.value
  assert program.user_exit_code(e) == errors.EXIT_BAD_INPUT, repr(e)
  assert not [r for r in caplog.records if r.exc_info], "a background traceback was logged"
  err = capfd.readouterr().err
  assert "Traceback" not in err and "Logging error" not in err, err[-3000:]
  assert not (workdir / workdir_lib.LOCK_NAME).exists()
  return program.message(e)


_ALLOW: dict = {}
HINT = "free space there or use"


@pytest.mark.parametrize(
    "pattern, names",
    [
        ("config.json*", "config.json"),
        ("run.json*", "run.json"),
        ("events.out.tfevents.*", "tensorboard"),
        ("train.log", "train.log"),
        ("metrics.jsonl", "metrics.jsonl"),
        ("launches.jsonl", "launches.jsonl"),
    ],
)
def test_a_full_disk_under_a_run_file_is_one_line_naming_it(
    tmp_path, caplog, capfd, pattern, names
):
  line = _stop(tmp_path / "run", pattern, caplog, capfd)
  assert "No space left on device" in line and names in line and HINT in line, line
  assert "\n" not in line


def test_a_full_disk_under_the_change_record_is_one_line_naming_it(tmp_path, caplog, capfd):
  workdir = tmp_path / "run"
  train_and_evaluate(tiny_config(num_train_steps=2), workdir)
  _ALLOW["allow_config_change"] = True
  try:
    line = _stop(workdir, "config_changes.jsonl", caplog, capfd, seed=1, num_train_steps=4)
  finally:
    _ALLOW.clear()
  assert "No space left on device" in line and "config_changes.jsonl" in line, line


def test_a_full_disk_under_a_checkpoint_is_one_line_naming_it(tmp_path, monkeypatch, caplog, capfd):
  # The meta item's write, in orbax's background save, finds the disk full.
  async def full(self, x, directory):
    del self, x
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))

  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", full)
  line = _stop(tmp_path / "run", "(nothing else)", caplog, capfd)
  assert line.startswith("No space left on device in ") and str(tmp_path / "run") in line, line
  assert line.count("free space") == 1 and "writing a checkpoint failed" in line, line
