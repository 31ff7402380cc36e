"""Bucketing and packing over real processes: 2 processes (1 CPU device each, gloo) read the
rows of their row group of the global batches one process reads; with "seq" across the two
they form one group and both read whole batches."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from tests.train import read_batches
from tests.train import test_multiprocess as mp


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
  out = tmp_path_factory.mktemp("batches")
  proc = subprocess.Popen(
      [mp.LAUNCH, "2", f"--log_dir={out}/logs", "--", "tests/train/read_batches.py", str(out)],
      cwd=mp.ROOT,
      env=mp._env(DEVICES_PER_PROCESS="1", GRACE_S="10"),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      start_new_session=True,
  )
  mp._finish(proc, "2 processes reading batches")
  return out


# Slow (two processes); the default run keeps two processes in tests/train/test_multiprocess.py.
@pytest.mark.slow
@pytest.mark.parametrize("name", list(read_batches.LAYOUTS))
def test_each_process_reads_its_rows_of_the_global_batches(two_processes, name):
  want = read_batches.read(name)  # this process alone: the global batches
  got = [dict(np.load(two_processes / f"{name}_process_{p}.npz")) for p in (0, 1)]
  assert got[0].keys() == got[1].keys() == want.keys()
  whole = name.endswith("_seq")  # one row group: both read every row
  for key, rows in want.items():
    half = len(rows) // 2
    for p in (0, 1):
      mine = rows if whole else rows[p * half : (p + 1) * half]
      np.testing.assert_array_equal(got[p][key], mine, err_msg=f"{key}, process {p}")
  assert any(k.startswith("eval_") for k in want) and "train_4_inputs" in want
