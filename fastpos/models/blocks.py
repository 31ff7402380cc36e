"""The transformer block shared by every model: attention + MLP with residuals and norms.

``norm="post"`` (LRA's layout, Vaswani et al.): ``x = LN(x + Drop(Attn(x)))``,
``x = LN(x + Drop(MLP(x)))``. ``norm="pre"``: ``x = x + Drop(Attn(LN(x)))``,
``x = x + Drop(MLP(LN(x)))`` (the model adds a final LN). ``norm="batch"``: post-norm with
BatchNorm over the real tokens (LRPE's LRA setup), statistics in the ``batch_stats``
collection. Dropout follows the attention and the MLP outputs (the fused softmax and the
linear paths have no attention-weight dropout).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fastpos.models import decoding
from fastpos.models.attention import Attention, AttentionConfig
from fastpos.ops.masks import check_mask

NORMS = ("post", "pre", "batch")
# model.remat: what a block keeps for its backward pass (a jax.checkpoint policy; "none" keeps
# whatever autodiff saves, "block" only the block's input, "save_matmuls" also the outputs of
# the projection and MLP matmuls, "save_dots" those and the batched attention products).
REMAT_POLICIES = ("none", "block", "save_matmuls", "save_dots")


def remat_policy(name: str):
  """The ``jax.checkpoint`` policy of a ``model.remat`` value (None for "none")."""
  if name not in REMAT_POLICIES:
    raise ValueError(f"unknown model.remat {name!r}; valid choices: "
                     f"{', '.join(REMAT_POLICIES)}.")
  return {"none": None, "block": jax.checkpoint_policies.nothing_saveable,
          "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
          "save_dots": jax.checkpoint_policies.checkpoint_dots}[name]


class MLP(nn.Module):
  """``[b, N, D] -> [b, N, D]``: Dense(mlp_dim) -> GELU -> Dropout -> Dense(D)."""
  mlp_dim: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, *, deterministic: bool):
    y = nn.Dense(self.mlp_dim, dtype=self.dtype, name="fc1")(x)
    y = nn.gelu(y)
    y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    return nn.Dense(x.shape[-1], dtype=self.dtype, name="fc2")(y)


class Block(nn.Module):
  """One transformer layer. ``shared``: scheme modules shared across layers."""
  attention: AttentionConfig
  mlp_dim: int
  dropout_rate: float = 0.0
  norm: str = "post"
  shared: tuple = ()
  dtype: Any = jnp.float32

  def _make_norm(self, name: str, train: bool):
    if self.norm == "batch":
      return nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype,
                          name=name)
    return nn.LayerNorm(dtype=self.dtype, name=name)

  @staticmethod
  def _apply(norm, x, mask):
    if isinstance(norm, nn.BatchNorm) and mask is not None:
      return norm(x, mask=jnp.broadcast_to(mask[..., None], x.shape))
    return norm(x)

  @nn.compact
  def __call__(self, x, *, mask=None, grid=None, memory=None, memory_mask=None,
               train: bool = False, reference: bool = False, decode=None):
    """``x [b, N, D] -> [b, N, D]``; ``mask [b, N]`` True for real tokens (all real when
    None); ``memory [b, M, D]`` (Transformer-XL) is this layer's input of the previous
    segment(s), ``memory_mask [b, M]`` True where it holds a real token (all real when None).
    Masks are boolean only: any other dtype or shape raises ValueError. ``decode``: a
    ``fastpos.models.decoding.Step`` (x holds new tokens; attention reads its cache)."""
    return self._forward(x, mask, grid, memory, memory_mask, train, reference, decode)

  def _forward(self, x, mask, grid, memory, memory_mask, train, reference, decode):
    """The layer (called from a compact ``__call__``: it creates the submodules)."""
    if self.norm not in NORMS:
      raise ValueError(f"unknown norm {self.norm!r}; valid choices: {', '.join(NORMS)}.")
    mask = check_mask(mask, x.shape[:2], against=f"x of shape {x.shape}")
    if memory is not None:
      memory_mask = check_mask(memory_mask, memory.shape[:2], name="memory_mask",
                               layout="[batch, M]", against=f"memory of shape {memory.shape}")
    attn = Attention(self.attention, shared=self.shared, dtype=self.dtype, name="attention")
    drop = nn.Dropout(self.dropout_rate)
    mlp = MLP(self.mlp_dim, self.dropout_rate, dtype=self.dtype, name="mlp")
    norm1 = self._make_norm("norm_attention", train)
    norm2 = self._make_norm("norm_mlp", train)
    amask = mask
    if memory is not None and (mask is not None or memory_mask is not None):
      mm = jnp.ones(memory.shape[:2], bool) if memory_mask is None else memory_mask
      amask = jnp.concatenate([mm, jnp.ones(x.shape[:2], bool) if mask is None else mask],
                              axis=1)
    kw = dict(mask=amask, grid=grid, deterministic=not train, reference=reference)
    if decode is not None:  # a decoding step (fastpos.models.decoding)
      kw["decode"] = decode
    if self.norm == "pre":
      mem = None if memory is None else self._apply(norm1, memory, None)
      x = x + drop(attn(self._apply(norm1, x, mask), memory=mem, **kw),
                   deterministic=not train)
      return x + drop(mlp(self._apply(norm2, x, mask), deterministic=not train),
                      deterministic=not train)
    y = attn(x, memory=memory, **kw)
    x = self._apply(norm1, x + drop(y, deterministic=not train), mask)
    y = mlp(x, deterministic=not train)
    return self._apply(norm2, x + drop(y, deterministic=not train), mask)


class Layer(Block):
  """A ``Block`` whose call settings are fields and whose arguments are arrays (or None): the
  body that ``nn.remat`` and ``nn.scan`` wrap (a traced argument cannot steer Python control
  flow). Same parameters as ``Block``. ``__call__(x, mask, memory, memory_mask, offset)`` ->
  ``(y, new_memory)``: ``new_memory`` is the layer's Transformer-XL memory for the next
  segment (its input appended to ``memory``, the last M kept, stop-gradient; None without
  memory); ``offset`` is the decoding slot when ``decoding`` (``fastpos.models.decoding``)."""
  train: bool = False
  reference: bool = False
  decoding: bool = False
  cache_length: int | None = None

  @nn.compact
  def __call__(self, x, mask, memory, memory_mask, offset):
    new_memory = None
    if memory is not None:
      new_memory = jax.lax.stop_gradient(
          jnp.concatenate([memory, x.astype(memory.dtype)], axis=1)[:, -memory.shape[1]:])
    decode = None
    if self.decoding:
      decode = decoding.Step(offset=offset, cache_length=self.cache_length)
    y = self._forward(x, mask, self.attention.grid, memory, memory_mask, self.train,
                      self.reference, decode)
    return y, new_memory
