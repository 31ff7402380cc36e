"""Figures of the learned positional parameters of a trained workdir (PNG, matplotlib Agg).

  python scripts/plot_positional.py WORKDIR [--out DIR] [--checkpoint best|latest]
      [--pixel 12,10]

Reads the checkpoint through the trainer's checkpoint code (``fastpos.train.checkpoint``;
``best``, the one eval.py scores, falling back to the newest) and plots, for every layer,
whatever positional parameters the model has (``fastpos.plots.positional`` draws them; scheme
modules are named ``pos_<scheme>`` in the parameter tree, ``pos_<scheme>_shared`` when shared
across layers):

* ``fastrpb_1d.png``: FastRPB's ``w`` against the relative distance j - i (key minus query),
  one panel per layer, one line per head with ``per_head`` (FastRPB Fig. 1; the paper draws
  the same values as a colour strip).
* ``fastrpb_2d_pixel_R_C.png``: the 2D bias seen by the query pixel (R, C): the image
  ``W2d[p, q]`` over every key pixel q, i.e. ``w_rows[r_q - R] + w_cols[c_q - C]`` (axial)
  or ``w[r_q - R, c_q - C]`` (full) (FastRPB Fig. 2, pixel (12, 10) of MNIST 28x28; the
  default pixel is (12, 10) when it lies on the grid, else the centre), plus
  ``fastrpb_2d_tables.png`` with the row / column tables (axial) or the full offset table.
* ``kernelized_rpe.png``: the table ``b_{j-i}`` of Luo et al. (``c = exp(b)`` reweights the
  keys inside numerator and denominator) per head against j - i; in 2D the ``[2H-1, 2W-1]``
  table over (row, column) offsets per head.
* ``lrpe_theta.png``: LRPE's learned angles ``theta_k`` (log scale of |theta|) against the
  index k, per layer, one line per head with ``per_head``.

Writes into ``--out`` (default ``WORKDIR/figures``) and prints each file's path. A model
without any of these parameters writes nothing and says so (exit status 0).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")

from fastpos.plots import positional  # noqa: E402  (after the backend is chosen)
from fastpos.train.errors import RunError  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
def load_checkpoint(workdir: Path, which: str = "best") -> tuple[dict, dict]:
  """(params as nested dicts of numpy arrays, checkpoint meta) of a workdir, read through its
  owner (``fastpos.train.workdir.Workdir``: the run's check, the verified restore)."""
  from fastpos.train.workdir import Workdir  # pylint: disable=import-outside-toplevel

  run = Workdir(workdir)
  run.require_run()
  # No abstract target: the saved tree comes back as nested dicts of arrays.
  found = run.restore(None, which)
  return _to_numpy(found.state["params"]), {**found.meta, "which": run.which(found)}


def _to_numpy(tree: Any) -> Any:
  if isinstance(tree, dict):
    return {k: _to_numpy(v) for k, v in tree.items()}
  return np.asarray(tree)


def plot_workdir(
    workdir: Path, out: Path, *, which: str = "best", pixel: tuple[int, int] | None = None
) -> list[Path]:
  """Writes every figure that the workdir's checkpoint supports; returns the files."""
  from fastpos.train import metrics  # pylint: disable=import-outside-toplevel

  with metrics.quiet_library_logs():  # orbax warns that a read-only folder is read only
    params, meta = load_checkpoint(workdir, which)
  return positional.plot_params(params, meta, out, pixel=pixel)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("workdir", type=Path)
  p.add_argument("--out", type=Path, default=None, help="default: WORKDIR/figures")
  p.add_argument("--checkpoint", default="best", choices=("best", "latest"))
  p.add_argument(
      "--pixel",
      default=None,
      help="2D: the query pixel ROW,COL (default 12,10 " "when on the grid, else the centre)",
  )
  args = p.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a checkpoint read needs no accelerator
  pixel = None
  if args.pixel:
    try:
      pixel = tuple(int(v) for v in args.pixel.split(","))
    except ValueError:
      pixel = ()
    if len(pixel) != 2:
      print(f"plot_positional: --pixel must be ROW,COL; got {args.pixel!r}.", file=sys.stderr)
      return 2
  try:
    written = plot_workdir(
        args.workdir, args.out or args.workdir / "figures", which=args.checkpoint, pixel=pixel
    )
  except (FileNotFoundError, ValueError, RunError) as e:
    print(f"plot_positional: {e}", file=sys.stderr)
    return 2
  if not written:
    print(
        f"plot_positional: {args.workdir} has no FastRPB, kernelized-RPE or LRPE parameters; "
        "nothing written.",
        file=sys.stderr,
    )
  for path in written:
    print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
