"""Inputs beside the config values, each refused in one line that says the real problem: a
config file that does not import or whose get_config raises, symlink loops (config, workdir,
data root), a data root that is a file, and the programs' own flags (generate.py,
download_data.py, sweep.py, launch_local.sh). In process where the program allows it."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path

import pytest

from fastpos.sweep import cli as sweep_cli
from fastpos.tasks import download as download_data
from fastpos.tasks import paths
from fastpos.train import cli, errors, program
from fastpos.train import workdir as workdir_lib

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def loop(tmp_path) -> Path:
  a, b = tmp_path / "loop_a", tmp_path / "loop_b"
  a.symlink_to(b)
  b.symlink_to(a)
  return a


def _one_line(e: BaseException, *needles: str) -> str:
  text = program.message(e)
  assert "\n" not in str(e), str(e)
  for needle in needles:
    assert needle in text, (needle, text)
  return text


@pytest.mark.parametrize(
    "body, needles",
    [
        (
            "import not_a_module_here\ndef get_config(arg=None):\n  return None\n",
            ["bad.py:1: imports 'not_a_module_here', which is not installed"],
        ),
        (
            "def get_config(arg=None):\n  return {}['model']\n",
            ["bad.py:2: get_config raised KeyError: 'model'; fix the config file."],
        ),
        (
            "x = 1 / 0\ndef get_config(arg=None):\n  return None\n",
            ["bad.py:1: loading the file raised ZeroDivisionError: division by zero"],
        ),
    ],
)
def test_a_config_file_that_fails_is_one_line(tmp_path, body, needles):
  (tmp_path / "bad.py").write_text(body)
  with pytest.raises(cli.ConfigError) as info:
    cli.load_config(str(tmp_path / "bad.py"))
  _one_line(info.value, *needles)
  assert program.user_exit_code(info.value) == errors.EXIT_BAD_INPUT


def test_symlink_loops_are_called_loops(loop, tmp_path):
  with pytest.raises(cli.ConfigError, match=r"loop_a' is a symlink loop"):
    cli.load_config(str(loop))
  with pytest.raises(errors.RunError, match=rf"{loop} is a symlink loop"):
    workdir_lib.check_usable(loop / "run")
  error = paths.missing_data("listops", loop / "lra_release" / "x.tsv", str(loop))
  _one_line(error, f"{loop} is a symlink loop; point config.task.data_dir")


def test_a_data_root_that_is_a_file(tmp_path):
  root = tmp_path / "root"
  root.write_text("")
  error = paths.missing_data("listops", root / "lra_release" / "x.tsv", str(root))
  text = _one_line(error, f"{root} is a file, not a folder")
  assert "download_data" not in text  # no advice to download into a file
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    assert download_data.main(["listops", "--data_dir", str(root)]) == 2
  assert err.getvalue() == (
      f"error: --data_dir: {root} is a file, not a folder; give a folder "
      "(it is created when missing).\n"
  )


def test_argparse_errors_are_one_line(capsys):
  for main, argv in (
      (download_data.main, ["--bogus"]),
      (sweep_cli.main, ["--config=c.py", "--sweep_dir=d", "--mode=bogus"]),
  ):
    with pytest.raises(SystemExit) as info:
      main(argv)
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and ("--bogus" in lines[0] or "'bogus'" in lines[0]), lines


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"GRACE_S": "x"}, "GRACE_S must be an integer >= 0 (seconds); got 'x'."),
        ({"COORDINATOR_PORT": "99999"}, "COORDINATOR_PORT must be an integer in [1, 65535]; got"),
        ({}, "N=0 is not a number of processes >= 1"),
    ],
)
def test_launch_local_checks_its_arguments(tmp_path, env, needle):
  n = "0" if not env else "1"
  proc = subprocess.run(
      ["bash", str(ROOT / "scripts" / "launch_local.sh"), n, "--", "true"],
      env={**os.environ, **env},
      cwd=tmp_path,
      capture_output=True,
      text=True,
      timeout=60,
  )
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and needle in proc.stderr
  assert not (tmp_path / "launch_logs").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_under_the_metrics_names_the_file(tmp_path):
  from fastpos.train import metrics as metrics_lib  # pylint: disable=import-outside-toplevel

  writer = metrics_lib.MetricWriter(tmp_path, total_steps=2, resume_step=0)
  writer._jsonl.close()  # pylint: disable=protected-access
  # Writes to /dev/full fail with ENOSPC; the writer owns the file (closed by writer.close()),
  # so no `with` block.
  writer._jsonl = open("/dev/full", "a")  # noqa: SIM115  # pylint: disable=protected-access
  with pytest.raises(OSError) as info:
    writer.write(1, "train", {"loss": 1.0})
  writer.close()
  assert info.value.filename == str(tmp_path / "metrics.jsonl")
  assert program.message(info.value) == (
      f"No space left on device: '{tmp_path / 'metrics.jsonl'}'; the disk is full: free space "
      "there or use a --workdir on another disk."
  )
