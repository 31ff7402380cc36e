"""A "seq" mesh axis across processes: which rows each process reads, and a real run.

* ``row_group`` on meshes of fake devices: processes that hold blocks of the same rows form
  one group (and read the same rows); a mesh where processes share some rows but not all is
  refused, naming the rows.
* (slow) 2 processes x 1 device with mesh.seq=2 (each process holds half of every sequence;
  the ring Toeplitz product and the state psum go over gloo) log the metrics of 1 process x
  2 devices with mesh.seq=2, row by row.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from fastpos.train import sharding as sharding_lib
from tests.train import test_multiprocess as mp


def _mesh(procs, names):
  """A mesh-like object whose device at each position belongs to process ``procs[...]``."""
  procs = np.asarray(procs)
  devices = np.vectorize(lambda p: types.SimpleNamespace(process_index=int(p)), otypes=[object])(
      procs
  )
  return types.SimpleNamespace(
      devices=devices, axis_names=names, shape=dict(zip(names, procs.shape))
  )


@pytest.mark.parametrize(
    "procs, names, want",
    [
        # seq=4 over 2 processes x 2 devices, one row: both processes read it.
        ([[[0], [0], [1], [1]]], ("data", "seq", "model"), {0: (0, 1), 1: (0, 1)}),
        # seq=2 inside each process, 2 rows: each its own (the usual layout).
        ([[[0], [0]], [[1], [1]]], ("data", "seq", "model"), {0: (0, 2), 1: (1, 2)}),
        # 4 processes, data=2 x seq=2 across processes: two groups of two.
        (
            [[[0], [1]], [[2], [3]]],
            ("data", "seq", "model"),
            {0: (0, 2), 1: (0, 2), 2: (1, 2), 3: (1, 2)},
        ),
        # no seq axis: process order.
        ([[1], [0]], ("data", "model"), {0: (1, 2), 1: (0, 2)}),
    ],
)
def test_processes_holding_the_same_rows_read_the_same_rows(procs, names, want):
  mesh = _mesh(procs, names)
  assert {p: sharding_lib.row_group(mesh, p) for p in want} == want


def test_processes_sharing_some_rows_but_not_all_are_refused():
  mesh = _mesh([[[0], [0], [1]], [[1], [2], [2]]], ("data", "seq", "model"))
  with pytest.raises(
      ValueError,
      match=r"overlapping but different rows of the data axis " r"\(\[0\] and \[0, 1\]\)",
  ):
    sharding_lib.row_group(mesh, 0)


@pytest.mark.slow
def test_seq_across_two_processes_logs_what_one_process_logs(tmp_path):
  args = (*mp.ARGS, "--config.mesh.seq=2", "--config.num_train_steps=4")
  two, ref = tmp_path / "two_proc", tmp_path / "reference"
  launch = mp._start_launch(2, 1, *args, f"--workdir={two}")
  single = mp._start("train.py", 2, *args, f"--workdir={ref}")
  mp._finish(launch, "2-process run, mesh.seq=2")
  mp._finish(single, "1-process run, mesh.seq=2")
  got, want = mp._rows(two), mp._rows(ref)
  assert {split for _, split in want} >= {"train", "validation"}
  mp._assert_rows_close(got, want, sorted(want))
