"""Figures of learned positional parameters (PNG, matplotlib): FastRPB's 1D and 2D weights,
kernelized RPE's tables, LRPE's angles, one panel per layer (``scripts/plot_positional.py``
draws them from a workdir's checkpoint).

The parameters come as nested dicts of numpy arrays (a checkpoint's ``params``); scheme modules
are named ``pos_<scheme>`` in the tree, ``pos_<scheme>_shared`` when shared across layers.
``plot_params`` writes every figure a tree supports:

* ``fastrpb_1d.png``: FastRPB's ``w [(heads,) 2N-1]`` against the relative distance j - i (key
  minus query), one panel per layer, one line per head with ``per_head`` (FastRPB Fig. 1).
* ``fastrpb_2d_pixel_R_C.png``: the 2D bias seen by the query pixel (R, C), the image
  ``W2d[p, q]`` over every key pixel q (FastRPB Fig. 2), and ``fastrpb_2d_tables.png`` with
  the row / column tables (axial) or the full offset table.
* ``kernelized_rpe.png``: Luo et al.'s table ``b_{j-i}`` per head against j - i (1D), or the
  ``[2H-1, 2W-1]`` table over (row, column) offsets per head (2D).
* ``lrpe_theta.png``: LRPE's learned angles ``theta_k`` (log scale of |theta|) against k.

Needs matplotlib (the ``plots`` extra).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from fastpos.plots import distinct_colors, integer_ticks, layer_name

SCHEMES = ("fastrpb", "kernelized_rpe", "lrpe")
DEFAULT_PIXEL = (12, 10)


# ---------------------------------------------------------------------------------------------
# Reading a parameter tree
# ---------------------------------------------------------------------------------------------
def find_schemes(params: dict, prefix: tuple[str, ...] = ()) -> list[dict[str, Any]]:
  """Every ``pos_<scheme>`` module of SCHEMES in a parameter tree, in tree order:
  [{"scheme", "path" (a "/"-joined string), "layer", "arrays" {name: array}}]."""
  out = []
  for key in sorted(params, key=_natural):
    value = params[key]
    if not isinstance(value, dict):
      continue
    path = prefix + (key,)
    name = key[4:].removesuffix("_shared") if key.startswith("pos_") else None
    if name in SCHEMES:
      arrays = {k: v for k, v in value.items() if not isinstance(v, dict)}
      layer = next((p for p in reversed(prefix) if p.startswith("block_")), "shared")
      out.append({"scheme": name, "path": "/".join(path), "layer": layer, "arrays": arrays})
    else:
      out += find_schemes(value, path)
  return out


def _natural(key: str):
  head, _, tail = key.rpartition("_")
  return (head, int(tail)) if tail.isdigit() else (key, -1)


# ---------------------------------------------------------------------------------------------
# Pure helpers (tested against the library's dense references)
# ---------------------------------------------------------------------------------------------
def offsets(table_len: int) -> np.ndarray:
  """Relative distances j - i of a 1D table ``[2N-1]``: -(N-1) .. N-1."""
  if table_len % 2 != 1:
    raise ValueError(f"a relative table has odd length 2N-1; got {table_len}.")
  n = (table_len + 1) // 2
  return np.arange(-(n - 1), n)


def pixel_bias_2d(
    table: np.ndarray | None,
    grid: tuple[int, int],
    pixel: tuple[int, int],
    *,
    rows: np.ndarray | None = None,
    cols: np.ndarray | None = None,
) -> np.ndarray:
  """The bias ``W2d[p, q]`` seen by the query pixel p over every key pixel q: ``[H, W]``.

  ``W2d[p, q] = w[r_q - r_p + H-1, c_q - c_p + W-1]`` for a full table ``[2H-1, 2W-1]``
  (``fastpos.ops.toeplitz.dense_toeplitz_2d``), or ``rows[r_q - r_p + H-1] + cols[c_q - c_p +
  W-1]`` for FastRPB's axial tables (Sec. 3.2.2, W2d = X + Y).
  """
  h, w = grid
  r0, c0 = pixel
  if not (0 <= r0 < h and 0 <= c0 < w):
    raise ValueError(f"pixel {pixel} is outside the grid {grid}.")
  dr = np.arange(h)[:, None] - r0 + h - 1
  dc = np.arange(w)[None, :] - c0 + w - 1
  if table is not None:
    if table.shape != (2 * h - 1, 2 * w - 1):
      raise ValueError(
          f"a full 2D table for grid {grid} is [{2 * h - 1}, {2 * w - 1}]; got " f"{table.shape}."
      )
    return table[dr, dc]
  if rows is None or cols is None:
    raise ValueError("pass a full table, or both the row and the column tables.")
  return rows[dr] + cols[dc]


def default_pixel(grid: tuple[int, int]) -> tuple[int, int]:
  h, w = grid
  if DEFAULT_PIXEL[0] < h and DEFAULT_PIXEL[1] < w:
    return DEFAULT_PIXEL
  return (h // 2, w // 2)


def _heads(a: np.ndarray, base_ndim: int) -> np.ndarray:
  """A table with an optional leading head axis as ``[heads, ...]``."""
  return a[None] if a.ndim == base_ndim else a


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------
def _panels(n: int, *, width: float = 4.5, height: float = 3.0, cols: int = 4):
  ncol = min(n, cols)
  nrow = (n + ncol - 1) // ncol
  fig, axes = plt.subplots(nrow, ncol, figsize=(width * ncol, height * nrow), squeeze=False)
  for ax in axes.flat[n:]:
    ax.axis("off")
  return fig, list(axes.flat[:n])


def _title(fig, text: str) -> None:
  """A suptitle wrapped to the figure's width (workdir names can be long)."""
  chars = max(40, int(fig.get_figwidth() * 15))
  lines = [textwrap.fill(part, chars) for part in text.split("\n")]
  fig.suptitle("\n".join(lines), fontsize=9)


def _save(fig, path: Path, written: list[Path]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  written.append(path)


def plot_1d(
    entries: list[dict], key: str, title: str, ylabel: str, path: Path, written: list[Path]
) -> None:
  """One panel per layer: ``table[..., 2N-1]`` against j - i, a line per head."""
  fig, axes = _panels(len(entries))
  for ax, e in zip(axes, entries):
    t = _heads(e["arrays"][key], 1)
    x = offsets(t.shape[-1])
    for i, (row, color) in enumerate(zip(t, distinct_colors(len(t)))):
      ax.plot(x, row, lw=1, color=color, label=f"head {i + 1}" if len(t) > 1 else None)
    ax.axhline(0, color="0.7", lw=0.5)
    ax.set(
        title=layer_name(e["layer"]), xlabel="relative distance j - i (key - query)", ylabel=ylabel
    )
    integer_ticks(ax.xaxis)
    if len(t) > 1:
      ax.legend(fontsize=7, ncol=1 + len(t) // 9)
  _title(fig, title)
  _save(fig, path, written)


def _image(fig, ax, img, title, extent=None, xlabel="column", ylabel="row"):
  lim = float(np.max(np.abs(img))) or 1.0
  im = ax.imshow(img, cmap="RdBu_r", vmin=-lim, vmax=lim, extent=extent, origin="upper")
  ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
  integer_ticks(ax.xaxis, ax.yaxis)  # pixels and offsets
  fig.colorbar(im, ax=ax, shrink=0.8)


def plot_fastrpb_2d(
    entries: list[dict],
    grid: tuple[int, int],
    options: dict,
    pixel: tuple[int, int],
    out: Path,
    written: list[Path],
    about: str = "",
) -> None:
  """``about``: the run the weights come from (a second title line)."""
  h, w = grid
  mode = options.get("mode_2d", "axial")
  per_head = bool(options.get("per_head", False))
  shared_axes = bool(options.get("shared_axes", False))
  slices, tables = [], []  # (title, [H, W] image) / (title, kind, arrays)
  for e in entries:
    a = e["arrays"]
    if mode == "full":
      t = a["w"] if per_head else a["w"][None]
      for i, th in enumerate(t):
        tag = layer_name(e["layer"]) + (f", head {i + 1}" if per_head else "")
        slices.append((tag, pixel_bias_2d(th, grid, pixel)))
        tables.append((tag, "full", th))
    else:
      rows = a["w"] if shared_axes else a["w_rows"]
      cols = a["w"] if shared_axes else a["w_cols"]
      rows, cols = (rows, cols) if per_head else (rows[None], cols[None])
      for i, (rh, ch) in enumerate(zip(rows, cols)):
        tag = layer_name(e["layer"]) + (f", head {i + 1}" if per_head else "")
        slices.append((tag, pixel_bias_2d(None, grid, pixel, rows=rh, cols=ch)))
        tables.append((tag, "axial", (rh, ch)))
  fig, axes = _panels(len(slices), width=4.0, height=3.6)
  for ax, (tag, img) in zip(axes, slices):
    _image(fig, ax, img, tag)
    ax.plot([pixel[1]], [pixel[0]], "k+", ms=10)
  _title(
      fig,
      f"FastRPB 2D ({mode}): bias W2d[p, q] seen by pixel p = {pixel} over key "
      f"pixels q, grid {h}x{w}" + (f"\n{about}" if about else ""),
  )
  _save(fig, out / f"fastrpb_2d_pixel_{pixel[0]}_{pixel[1]}.png", written)

  fig, axes = _panels(len(tables), width=4.0, height=3.2)
  for ax, (tag, kind, t) in zip(axes, tables):
    if kind == "full":
      _image(
          fig,
          ax,
          t,
          tag,
          extent=(-(w - 1) - 0.5, w - 0.5, h - 0.5, -(h - 1) - 0.5),
          xlabel="column offset",
          ylabel="row offset",
      )
    else:
      rows_color, cols_color = distinct_colors(2)
      ax.plot(offsets(len(t[0])), t[0], color=rows_color, label="rows (vertical offset)")
      ax.plot(offsets(len(t[1])), t[1], color=cols_color, label="columns (horizontal offset)")
      ax.set(title=tag, xlabel="offset (key - query)", ylabel="w")
      integer_ticks(ax.xaxis)
      ax.legend(fontsize=7)
  _title(
      fig,
      f"FastRPB 2D weight tables ({mode}) against the key - query offset"
      + (f"\n{about}" if about else ""),
  )
  _save(fig, out / "fastrpb_2d_tables.png", written)


def plot_kernelized_rpe_2d(
    entries: list[dict], grid: tuple[int, int], out: Path, written: list[Path], about: str = ""
) -> None:
  h, w = grid
  images = [
      (f"{layer_name(e['layer'])}, head {i + 1}", t)
      for e in entries
      for i, t in enumerate(e["arrays"]["b"])
  ]
  fig, axes = _panels(len(images), width=4.0, height=3.2)
  for ax, (tag, t) in zip(axes, images):
    _image(
        fig,
        ax,
        t,
        tag,
        extent=(-(w - 1) - 0.5, w - 0.5, h - 0.5, -(h - 1) - 0.5),
        xlabel="column offset (key - query)",
        ylabel="row offset",
    )
  _title(
      fig,
      "Kernelized RPE 2D table b against the key - query offset (Luo et al.; keys "
      "weighted by exp(b))" + (f"\n{about}" if about else ""),
  )
  _save(fig, out / "kernelized_rpe.png", written)


def plot_lrpe(entries: list[dict], out: Path, written: list[Path], about: str = "") -> None:
  entries = [e for e in entries if "theta" in e["arrays"]]
  if not entries:
    return
  fig, axes = _panels(len(entries))
  for ax, e in zip(axes, entries):
    t = _heads(e["arrays"]["theta"], 1)
    for i, (row, color) in enumerate(zip(t, distinct_colors(len(t)))):
      ax.semilogy(
          np.arange(len(row)),
          np.abs(row) + 1e-12,
          lw=1,
          marker=".",
          ms=3,
          color=color,
          label=f"head {i + 1}" if len(t) > 1 else None,
      )
    ax.set(
        title=layer_name(e["layer"]), xlabel="angle index k", ylabel="|theta_k| (rad per position)"
    )
    integer_ticks(ax.xaxis)
    if len(t) > 1:
      ax.legend(fontsize=7, ncol=1 + len(t) // 9)
  _title(fig, "LRPE learned angles theta_k, per layer" + (f"\n{about}" if about else ""))
  _save(fig, out / "lrpe_theta.png", written)


def run_description(meta: dict) -> str:
  """``task lra_text, kernel sikf, positional absolute+fastrpb, 4 layers (best checkpoint,
  step 5000)``: what a figure's weights come from, from the checkpoint's config."""
  config = meta.get("config", {})
  model = config.get("model", {})
  parts = [f"task {config.get('task', {}).get('name', '?')}"]
  if "kernel" in model:
    parts.append(f"kernel {model['kernel']}")
  if "positional" in model:
    positional = model["positional"]
    if isinstance(positional, (list, tuple)):
      positional = "+".join(positional)
    parts.append(f"positional {positional}")
  if "num_layers" in model:
    parts.append(f"{model['num_layers']} layers")
  return f"{', '.join(parts)} ({meta.get('which', '?')} checkpoint, step {meta.get('step', '?')})"


def plot_params(
    params: dict, meta: dict, out: Path, *, pixel: tuple[int, int] | None = None
) -> list[Path]:
  """Writes into ``out`` every figure that ``params`` (nested dicts of numpy arrays) supports;
  returns the files. ``meta``: the checkpoint's ``{"config": the run's config as a dict,
  "which", "step"}`` (the task's grid, the schemes' options and the figures' subtitle)."""
  task = meta["config"]["task"]
  grid = tuple(task["grid"]) if task.get("grid") else None
  options = meta["config"]["model"].get("positional_options", {})
  found = find_schemes(params)
  out.mkdir(parents=True, exist_ok=True)
  written: list[Path] = []
  by = {s: [e for e in found if e["scheme"] == s] for s in SCHEMES}
  about = run_description(meta)
  if by["fastrpb"]:
    if grid is None:
      plot_1d(
          by["fastrpb"],
          "w",
          f"FastRPB 1D weights w_(j-i) against the key - query " f"offset\n{about}",
          "w",
          out / "fastrpb_1d.png",
          written,
      )
    else:
      plot_fastrpb_2d(
          by["fastrpb"],
          grid,
          options.get("fastrpb", {}),
          pixel or default_pixel(grid),
          out,
          written,
          about,
      )
  if by["kernelized_rpe"]:
    if grid is None:
      plot_1d(
          by["kernelized_rpe"],
          "b",
          f"Kernelized RPE b_(j-i) against the key - query "
          f"offset (keys weighted by exp(b))\n{about}",
          "b",
          out / "kernelized_rpe.png",
          written,
      )
    else:
      plot_kernelized_rpe_2d(by["kernelized_rpe"], grid, out, written, about)
  if by["lrpe"]:
    plot_lrpe(by["lrpe"], out, written, about)
  return written
