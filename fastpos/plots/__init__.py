"""What every figure of fastpos shares (benchmarks, learned positional tables): a colour per
series that no other series of the figure has, integer ticks on integer axes, readable names
for layers, and the machine a measurement was taken on.

``fastpos.plots.positional`` draws the learned positional tables. Needs matplotlib (the
``plots`` extra): in fastpos only the claims' figures (``fastpos.sweep.claims``) import it, at
call time; the benchmarks and the plotting scripts do too.
"""

from __future__ import annotations

import os
import platform

import matplotlib
import numpy as np
from matplotlib.ticker import FixedLocator, MaxNLocator, NullLocator


def distinct_colors(n: int) -> list[tuple[float, float, float, float]]:
  """``n`` RGBA colours, no two equal: tab10 up to 10 series, tab20 up to 20, else ``n``
  evenly spaced samples of the ``turbo`` colormap."""
  if n <= 10:
    cmap, values = matplotlib.colormaps["tab10"], np.arange(n) / 10 + 0.05
  elif n <= 20:
    cmap, values = matplotlib.colormaps["tab20"], np.arange(n) / 20 + 0.025
  else:
    cmap, values = matplotlib.colormaps["turbo"], np.linspace(0.0, 1.0, n)
  return [tuple(float(c) for c in cmap(v)) for v in values]


def integer_ticks(*axes) -> None:
  """Integer tick values on each axis (``ax.xaxis``, ``ax.yaxis``): steps, layers, offsets."""
  for axis in axes:
    axis.set_major_locator(MaxNLocator(integer=True))


def ticks_at(axis, values) -> None:
  """Major ticks exactly at ``values`` (e.g. the measured lengths N on a log axis), labelled as
  plain integers (1024, 65536), no minor ticks."""
  values = sorted({int(v) for v in values})
  axis.set_major_locator(FixedLocator(values))
  axis.set_minor_locator(NullLocator())
  axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{int(round(v))}"))


def layer_name(key: str) -> str:
  """A parameter-tree key as a reader says it: ``block_0`` -> ``layer 1``, ``shared`` ->
  ``all layers (shared)``."""
  if key.startswith("block_") and key[6:].isdigit():
    return f"layer {int(key[6:]) + 1}"
  if key == "shared":
    return "all layers (shared)"
  return key


def machine() -> str:
  """``cpu: cpu (Intel Xeon ..., 2 cores)`` / ``gpu: NVIDIA H100 80GB HBM3 (..., 16 cores)``:
  the JAX device and the host processor, for a benchmark figure's subtitle."""
  import jax  # only benchmark figures need it

  dev = jax.devices()[0]
  return f"{dev.platform}: {dev.device_kind} ({cpu_name()}, {os.cpu_count()} cores)"


def cpu_name() -> str:
  """The host processor's model name (/proc/cpuinfo; else what ``platform`` reports)."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return names[0] if names else cpu
  except OSError:
    return cpu
