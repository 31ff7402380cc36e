"""fastpos.plots and the positional figures (fastpos.plots.positional), rendered with the Agg
backend into a temporary folder: titles say what is shown (no raw parameter keys), integer
axes have integer ticks, and no two lines of a panel share a colour."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from fastpos import plots  # noqa: E402
from fastpos.plots import positional as plot_positional  # noqa: E402


@pytest.fixture
def figures(monkeypatch):
  """The figures plot_positional saves, in order (still inspectable once closed)."""
  saved = []
  original = plot_positional._save

  def save(fig, path, written):
    saved.append(fig)
    original(fig, path, written)

  monkeypatch.setattr(plot_positional, "_save", save)
  return saved


def _line_colors(ax):
  return [
      matplotlib.colors.to_rgba(line.get_color())
      for line in ax.get_lines()
      if not line.get_label().startswith("_")
  ]


def _assert_distinct(ax, n):
  colors = _line_colors(ax)
  assert len(colors) == n
  assert len(set(colors)) == n, f"{ax.get_title()}: lines share a colour"


def _assert_integer_ticks(axis):
  low, high = sorted(axis.get_view_interval())  # an image's y axis runs downwards
  ticks = [t for t in axis.get_ticklocs() if low <= t <= high]
  assert ticks and all(float(t).is_integer() for t in ticks), ticks


@pytest.mark.parametrize("n", [3, 10, 12, 25])
def test_distinct_colors(n):
  colors = plots.distinct_colors(n)
  assert len(colors) == n and len(set(colors)) == n


def test_layer_names():
  assert plots.layer_name("block_0") == "layer 1"
  assert plots.layer_name("shared") == "all layers (shared)"


def test_positional_1d_figure(figures, tmp_path):
  entries = [
      {
          "scheme": "fastrpb",
          "layer": f"block_{i}",
          "path": "",
          "arrays": {"w": np.random.default_rng(i).normal(size=(12, 31))},
      }
      for i in range(2)
  ]
  meta = {
      "config": {
          "task": {"name": "lra_text"},
          "model": {"kernel": "sikf", "positional": ["absolute", "fastrpb"], "num_layers": 2},
      },
      "which": "best",
      "step": 40,
  }
  about = plot_positional.run_description(meta)
  assert about == (
      "task lra_text, kernel sikf, positional absolute+fastrpb, 2 layers "
      "(best checkpoint, step 40)"
  )
  plot_positional.plot_1d(entries, "w", f"FastRPB 1D weights\n{about}", "w", tmp_path / "w.png", [])
  (fig,) = figures
  assert fig._suptitle.get_text().endswith(about)
  assert [ax.get_title() for ax in fig.axes] == ["layer 1", "layer 2"]
  for ax in fig.axes:
    _assert_distinct(ax, 12)
    _assert_integer_ticks(ax.xaxis)


def test_positional_2d_and_lrpe_figures(figures, tmp_path):
  entries = [
      {
          "scheme": "fastrpb",
          "layer": "block_0",
          "path": "",
          "arrays": {"w_rows": np.linspace(-1, 1, 7), "w_cols": np.linspace(1, -1, 9)},
      }
  ]
  plot_positional.plot_fastrpb_2d(entries, (4, 5), {}, (1, 2), tmp_path, [], "task mnist")
  krpe = [
      {
          "scheme": "kernelized_rpe",
          "layer": "shared",
          "path": "",
          "arrays": {"b": np.arange(2 * 7 * 9.0).reshape(2, 7, 9)},
      }
  ]
  plot_positional.plot_kernelized_rpe_2d(krpe, (4, 5), tmp_path, [], "task mnist")
  lrpe = [
      {
          "scheme": "lrpe",
          "layer": "block_0",
          "path": "",
          "arrays": {"theta": np.random.default_rng(0).uniform(0.1, 1, size=(11, 8))},
      }
  ]
  plot_positional.plot_lrpe(lrpe, tmp_path, [], "task lra_text")
  pixel, tables, kernelized, angles = figures
  assert pixel._suptitle.get_text().startswith(
      "FastRPB 2D (axial): bias W2d[p, q] seen by " "pixel p = (1, 2)"
  )
  assert tables._suptitle.get_text().endswith("\ntask mnist")
  (ax,) = [a for a in tables.axes if a.get_title()]
  assert ax.get_title() == "layer 1"
  _assert_distinct(ax, 2)
  _assert_integer_ticks(ax.xaxis)
  for ax in [a for a in pixel.axes + kernelized.axes if a.get_images()]:
    _assert_integer_ticks(ax.xaxis)
    _assert_integer_ticks(ax.yaxis)
  assert [a.get_title() for a in kernelized.axes if a.get_images()] == [
      "all layers (shared), head 1",
      "all layers (shared), head 2",
  ]
  assert angles._suptitle.get_text() == "LRPE learned angles theta_k, per layer\ntask lra_text"
  (ax,) = [a for a in angles.axes if a.get_title()]
  _assert_distinct(ax, 11)
  _assert_integer_ticks(ax.xaxis)
