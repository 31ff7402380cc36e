"""``absolute``: absolute position embeddings added to the token embeddings (embed hook).

Vaswani et al. 2017, Sec. 3.5: ``x_i <- x_i + p_i``, with ``p`` either

* ``kind="learned"``: a table ``[max_length, D]`` initialised N(0, 0.02^2) (BERT / LRA), or
* ``kind="sinusoidal"``: fixed ``p_{i,2k} = sin(i / 10000^(2k/D))``,
  ``p_{i,2k+1} = cos(i / 10000^(2k/D))`` (no parameters).

2D grids (image tasks) get a 2D table: learned ``[H, W, D]`` (one vector per pixel, the
largest grid sliced to the batch's grid); sinusoidal uses the first half of the channels for
the row index and the second half for the column index.

Supports causal, 1D and 2D, and every kernel (it acts before attention). Not relative: the
shift tests of the relative schemes do not apply to it.

Long sequences split over devices (``mesh.seq`` > 1): the learned 1D table is sharded along
its position axis like the tokens (``position_params``), so a 1M x 256 table costs each of P
devices 1/P of it (and of its gradient and Adam moments); ``kind="sinusoidal"`` has no table.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from fastpos.ops import segments
from fastpos.positional.base import Context, Option, Scheme

KINDS = ("learned", "sinusoidal")


def sinusoid_table(positions, dim: int, *, base: float = 10000.0):
  """``[len(positions), dim]`` sinusoids (Vaswani Sec. 3.5); odd ``dim`` drops the last cos."""
  half = (dim + 1) // 2
  inv = base ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / dim)
  ang = jnp.asarray(positions, jnp.float32)[:, None] * inv[None, :]
  table = jnp.stack([jnp.sin(ang), jnp.cos(ang)], axis=-1).reshape(ang.shape[0], 2 * half)
  return table[:, :dim]


class AbsolutePositional(Scheme):
  """Absolute embeddings (options: ``option_spec``)."""

  option_spec = {
      "kind": Option("learned", "a learned table or fixed sinusoids", type="str", choices=KINDS)
  }

  scheme_name = "absolute"
  hooks = ("embed",)
  supports_2d = True
  packs = ("softmax", "linear")  # in-segment positions
  # Parameters indexed by absolute position: {name: (rank, position axis)}. On a sequence
  # split over the mesh axis "seq" the trainer shards them along it (fastpos.train.sharding),
  # each device holding the rows of its own block, with their gradient and optimizer moments.
  position_params = {"table": (2, 0)}

  def setup(self):
    if self.kind == "learned":
      shape = (
          (self.dims.max_length, self.dims.embed_dim)
          if self.dims.grid is None
          else (*self.dims.grid, self.dims.embed_dim)
      )
      self.table = self.param("table", nn.initializers.normal(stddev=0.02), shape)

  def _table(self, n: int, grid):
    d = self.dims.embed_dim
    if (grid is None) != (self.dims.grid is None):
      raise ValueError(
          f"absolute: built for grid {self.dims.grid} but called with grid {grid}; "
          f"build and call it with the same (1D: None; 2D: the task's grid)."
      )
    if grid is None:
      if n > self.dims.max_length:
        raise ValueError(f"absolute: length {n} exceeds max_length {self.dims.max_length}.")
      if self.kind == "learned":
        return self.table[:n]
      return sinusoid_table(jnp.arange(n), d)
    h, w = grid
    if self.kind == "learned":
      if self.dims.grid is None or h > self.dims.grid[0] or w > self.dims.grid[1]:
        raise ValueError(
            f"absolute: grid {tuple(grid)} exceeds the table's grid " f"{self.dims.grid}."
        )
      return self.table[:h, :w].reshape(h * w, d)
    rows = sinusoid_table(jnp.arange(h), d // 2)
    cols = sinusoid_table(jnp.arange(w), d - d // 2)
    return jnp.concatenate([jnp.repeat(rows, w, axis=0), jnp.tile(cols, (h, 1))], axis=-1)

  def embed(self, x, ctx: Context):
    """``x [b, N, D] -> x + p [b, N, D]`` (decoding: positions ``ctx.offset + i``)."""
    if ctx.offset is not None:
      pos = ctx.offset + jnp.arange(x.shape[1])
      if self.kind == "learned":
        table = jnp.take(self.table, pos, axis=0, mode="clip")
      else:
        table = sinusoid_table(pos, self.dims.embed_dim)
      return x + table[None].astype(x.dtype)
    segs = segments.active()
    if segs is not None and ctx.grid is None:  # a packed row: each sequence from position 0
      if self.kind == "learned":
        table = jnp.take(self.table[: x.shape[1]], segs.positions, axis=0, mode="clip")
      else:
        table = sinusoid_table(segs.positions.reshape(-1), self.dims.embed_dim).reshape(
            (*segs.positions.shape, -1)
        )
      return x + table.astype(x.dtype)
    return x + self._table(x.shape[1], ctx.grid)[None].astype(x.dtype)


SCHEMES = {"absolute": AbsolutePositional}
