"""The transformer block shared by every model: attention + MLP with residuals and norms.

``norm="post"`` (LRA's layout, Vaswani et al.): ``x = LN(x + Drop(Attn(x)))``,
``x = LN(x + Drop(MLP(x)))``. ``norm="pre"``: ``x = x + Drop(Attn(LN(x)))``,
``x = x + Drop(MLP(LN(x)))`` (the model adds a final LN). ``norm="batch"``: post-norm with
BatchNorm over the real tokens (LRPE's LRA setup), statistics in the ``batch_stats``
collection. Dropout follows the attention and the MLP outputs (the fused softmax and the
linear paths have no attention-weight dropout).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fastpos.models import chunked_attention, context_parallel, decoding, tokenwise
from fastpos.models.attention import (
    Attention,
    AttentionConfig,
    add_batch_axis,
    check_input,
    check_layer_schemes,
)
from fastpos.ops.masks import check_mask
from fastpos.positional import path_keys

NORMS = ("post", "pre", "batch")
# model.remat: what a block keeps for its backward pass (a jax.checkpoint policy; "none" keeps
# whatever autodiff saves, "block" only the block's input, "save_matmuls" also the outputs of
# the projection and MLP matmuls, "save_dots" those and the batched attention products).
REMAT_POLICIES = ("none", "block", "save_matmuls", "save_dots")


def remat_policy(name: str):
  """The ``jax.checkpoint`` policy of a ``model.remat`` value (None for "none")."""
  if name not in REMAT_POLICIES:
    raise ValueError(
        f"unknown model.remat {name!r}; valid choices: " f"{', '.join(REMAT_POLICIES)}."
    )
  return {
      "none": None,
      "block": jax.checkpoint_policies.nothing_saveable,
      "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
      "save_dots": jax.checkpoint_policies.checkpoint_dots,
  }[name]


def check_stack(layer: str, *, mlp_dim, dropout_rate, norm, num_layers=1, mlp_chunk=0) -> None:
  """Raises ValueError naming the first field of a block stack (``Block``, ``Tower``, the
  models) out of its range: ``mlp_dim`` and ``num_layers`` ints >= 1, ``dropout_rate`` in
  [0, 1), ``norm`` one of ``NORMS``, ``mlp_chunk`` an int >= 0 (not with BatchNorm)."""
  for name, value in (("mlp_dim", mlp_dim), ("num_layers", num_layers)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{layer}: {name} must be an int >= 1; got {value!r}.")
  if isinstance(dropout_rate, bool) or not (
      isinstance(dropout_rate, (int, float)) and 0 <= dropout_rate < 1
  ):
    raise ValueError(f"{layer}: dropout_rate must be a number in [0, 1); got {dropout_rate!r}.")
  if norm not in NORMS:
    raise ValueError(f"{layer}: unknown norm {norm!r}; valid choices: {', '.join(NORMS)}.")
  if tokenwise.check_chunk(mlp_chunk) and norm == "batch":
    raise ValueError(
        f"{layer}: mlp_chunk={mlp_chunk} chunks the token-wise part of the block, and "
        "norm='batch' is not token-wise (its statistics span the sequence); use mlp_chunk=0 "
        "or norm 'post' / 'pre'."
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def masked_scale(x, mask, keep: float):
  """``select(mask, x / keep, 0)`` (``nn.Dropout``'s formula, the same numbers) whose backward
  pass keeps only the boolean ``mask``: autodiff of the select also keeps a float zeros array
  of ``x``'s size."""
  return jax.lax.select(mask, x / keep, jnp.zeros_like(x))


def _masked_scale_fwd(x, mask, keep):
  return masked_scale(x, mask, keep), mask


def _masked_scale_bwd(keep, mask, g):
  return jax.lax.select(mask, g / keep, jnp.zeros_like(g)), None


masked_scale.defvjp(_masked_scale_fwd, _masked_scale_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def keyed_scale(x, key, keep: float):
  """``masked_scale(x, bernoulli(key, keep, x.shape), keep)`` whose backward pass keeps only
  the key and draws the mask again: nothing of ``x``'s size is stored (XLA would keep the
  generator's two 32-bit words per entry, fused into the backward's select, for a mask)."""
  return masked_scale(x, jax.random.bernoulli(key, p=keep, shape=x.shape), keep)


def _keyed_scale_fwd(x, key, keep):
  return keyed_scale(x, key, keep), key


def _after(key, g):
  """``key`` itself, made to depend on ``g`` (it changes only where g's first entry is NaN, and
  then the gradient is NaN anyway): XLA's scheduler would otherwise draw the backward pass's
  mask, which depends on the key alone, during the forward pass and keep it."""
  tie = jnp.isnan(g.reshape(-1)[0]).astype(jnp.uint32)
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    impl = jax.random.key_impl(key)
    return jax.random.wrap_key_data(jax.random.key_data(key) + tie, impl=impl)
  return key + tie


def _keyed_scale_bwd(keep, key, g):
  mask = jax.random.bernoulli(_after(key, g), p=keep, shape=g.shape)
  return jax.lax.select(mask, g / keep, jnp.zeros_like(g)), None


keyed_scale.defvjp(_keyed_scale_fwd, _keyed_scale_bwd)


class Dropout(nn.Module):
  """``nn.Dropout`` (its name, rng stream and masks: a run's numbers do not change) whose
  backward pass keeps only the key and draws the mask again (``keyed_scale``)."""

  rate: float

  def key(self, *, deterministic: bool):
    """The key this call draws its mask from (``nn.Dropout``'s), or None when nothing is
    dropped; ``make_mask`` draws the whole mask, ``tokenwise.bernoulli_at`` a slice."""
    if self.rate == 0.0 or deterministic:
      return None
    return self.make_rng("dropout")

  def make_mask(self, shape, *, deterministic: bool):
    """The keep mask (bool ``shape``) of this call, or None when nothing is dropped."""
    key = self.key(deterministic=deterministic)
    return None if key is None else jax.random.bernoulli(key, p=1.0 - self.rate, shape=shape)

  def __call__(self, x, *, deterministic: bool):
    if self.rate == 1.0 and not deterministic:
      return jnp.zeros_like(x)
    key = self.key(deterministic=deterministic)
    return x if key is None else keyed_scale(x, key, 1.0 - self.rate)


class _GeluDropDense(nn.Dense):
  """``Dense(Drop(GELU(h)))``: the MLP's second layer with its activation and dropout in front,
  under ``nn.remat`` (the same parameters as ``nn.Dense``): its backward pass recomputes the
  GELU from ``h`` instead of keeping the GELU's intermediates and the dropped activations
  (five ``[b, N, mlp_dim]`` float arrays)."""

  keep: float = 1.0

  @nn.compact
  def __call__(self, h, mask):
    y = nn.gelu(h)
    if mask is not None:
      y = masked_scale(y, mask, self.keep)
    return super().__call__(y)


class MLP(nn.Module):
  """``[b, N, D] -> [b, N, D]``: Dense(mlp_dim) -> GELU -> Dropout -> Dense(D). Its backward
  pass keeps the first layer's output and the boolean dropout mask (``_GeluDropDense``)."""

  mlp_dim: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, *, deterministic: bool, key_only: bool = False):
    """``key_only``: computes nothing and returns the key of this call's hidden dropout mask
    (None when nothing is dropped), for a block that draws the mask by chunk
    (``tokenwise``); ``x`` is not read."""
    if key_only:
      return Dropout(self.dropout_rate).key(deterministic=deterministic)
    h = nn.Dense(self.mlp_dim, dtype=self.dtype, name="fc1")(x)
    if self.dropout_rate == 1.0 and not deterministic:
      return nn.Dense(x.shape[-1], dtype=self.dtype, name="fc2")(jnp.zeros_like(h))
    mask = Dropout(self.dropout_rate).make_mask(h.shape, deterministic=deterministic)
    return nn.remat(_GeluDropDense)(
        x.shape[-1], dtype=self.dtype, keep=1.0 - self.dropout_rate, name="fc2"
    )(h, mask)


class Block(nn.Module):
  """One transformer layer ``x [b, N, D] -> [b, N, D]``: attention + MLP with residuals and
  norms (the module docstring's layouts).

  Called as ``block(x, mask=None, train=False)`` (every argument after ``x`` by keyword, as
  ``Attention``, ``Tower`` and the models); returns the array ``[b, N, D]`` (float, in
  ``dtype``). ``x`` may be one example ``[N, D]`` (``mask [N]``), run with a batch axis of one;
  any other rank, a width other than ``attention.embed_dim`` or N = 0 raises ValueError.

  Attributes:
    attention: the layer's ``AttentionConfig`` (attention-level schemes only:
      ``AttentionConfig.attention_only``; ``Tower`` runs the embed hook).
    mlp_dim: the MLP's hidden width.
    dropout_rate: after the attention and the MLP, in [0, 1).
    norm: ``"post"`` (LRA), ``"pre"`` or ``"batch"`` (``NORMS``).
    shared: scheme modules shared across layers (``share_across_layers``).
    dtype: activation dtype (parameters float32).
    mlp_chunk: C > 0: what follows the attention (dropout, residual, norms, MLP: token-wise)
      runs over chunks of C tokens, rematerialised chunk by chunk
      (``fastpos.models.tokenwise``): the same function, dropout masks included, with one
      chunk's MLP hidden alive at a time; not while decoding, nor at ``init``.

  Bad fields raise ValueError at construction.

  Example::

      cfg = fastpos.attention_config(32, 4, kernel="elu1", positional="fastrpb")
      block = fastpos.Block(cfg, mlp_dim=64, norm="pre")
      x = jnp.ones((2, 10, 32))                          # [batch, N, D] float32
      variables = block.init(jax.random.key(0), x)
      y = block.apply(variables, x, mask=jnp.ones((2, 10), bool))   # [2, 10, 32]
  """

  attention: AttentionConfig
  mlp_dim: int
  dropout_rate: float = 0.0
  norm: str = "post"
  shared: tuple = ()
  dtype: Any = jnp.float32
  mlp_chunk: int = 0

  def __post_init__(self):
    check_stack(
        "Block",
        mlp_dim=self.mlp_dim,
        dropout_rate=self.dropout_rate,
        norm=self.norm,
        mlp_chunk=self.mlp_chunk,
    )
    check_layer_schemes(self.attention, self.shared, "Block")
    super().__post_init__()

  def _make_norm(self, name: str, train: bool):
    if self.norm == "batch":
      return nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype, name=name)
    # Rematerialised: its backward keeps the input, not the centred, squared and scaled copies.
    return nn.remat(nn.LayerNorm)(dtype=self.dtype, name=name)

  @staticmethod
  def _apply(norm, x, mask):
    if isinstance(norm, nn.BatchNorm) and mask is not None:
      return norm(x, mask=jnp.broadcast_to(mask[..., None], x.shape))
    return norm(x)

  @nn.compact
  def __call__(
      self,
      x,
      *,
      mask=None,
      grid=None,
      memory=None,
      memory_mask=None,
      train: bool = False,
      reference: bool = False,
      decode=None,
  ):
    """``x [b, N, D] -> [b, N, D]``; ``mask [b, N]`` True for real tokens (all real when
    None); ``memory [b, M, D]`` (Transformer-XL) is this layer's input of the previous
    segment(s), ``memory_mask [b, M]`` True where it holds a real token (all real when None).
    Masks are boolean only: any other dtype or shape raises ValueError. ``decode``: a
    ``fastpos.models.decoding.Step`` (x holds new tokens; attention reads its cache).
    Returns ``[b, N, D]`` (``[N, D]`` for an unbatched ``x``)."""
    if check_input("Block", x, self.attention.embed_dim):  # one example: a batch axis of one
      x, mask, memory, memory_mask = add_batch_axis("Block", x, mask, memory, memory_mask)
      return self._forward(x, mask, grid, memory, memory_mask, train, reference, decode)[0]
    return self._forward(x, mask, grid, memory, memory_mask, train, reference, decode)

  def _forward(self, x, mask, grid, memory, memory_mask, train, reference, decode):
    """The layer (called from a compact ``__call__``: it creates the submodules)."""
    mask = check_mask(mask, x.shape[:2], against=f"x of shape {x.shape}")
    if memory is None and memory_mask is not None:
      raise ValueError("Block: memory_mask given without memory (it masks the memory keys).")
    if memory is not None:
      memory_mask = check_mask(
          memory_mask,
          memory.shape[:2],
          name="memory_mask",
          layout="[batch, M]",
          against=f"memory of shape {memory.shape}",
      )
    attn = Attention(self.attention, shared=self.shared, dtype=self.dtype, name="attention")
    drop = Dropout(self.dropout_rate)
    mlp = MLP(self.mlp_dim, self.dropout_rate, dtype=self.dtype, name="mlp")
    norm1 = self._make_norm("norm_attention", train)
    norm2 = self._make_norm("norm_mlp", train)
    amask = mask
    if memory is not None and (mask is not None or memory_mask is not None):
      mm = jnp.ones(memory.shape[:2], bool) if memory_mask is None else memory_mask
      amask = jnp.concatenate([mm, jnp.ones(x.shape[:2], bool) if mask is None else mask], axis=1)
    kw = dict(mask=amask, grid=grid, deterministic=not train, reference=reference)
    if decode is not None:  # a decoding step (fastpos.models.decoding)
      kw["decode"] = decode
    chunked = self._chunked(x, decode)
    if chunked and self._fused(attn, x, memory, decode, reference):
      # One chunk loop for the attention and what follows it: the block owns both.
      layer = attn.chunked_layer(x, mask=amask, grid=grid, deterministic=not train)
      return chunked_attention.attend(x, amask, layer, tail=self._tail(x, drop, mlp, train))
    if self.norm == "pre":
      mem = None if memory is None else self._apply(norm1, memory, None)
      y = attn(self._apply(norm1, x, mask), memory=mem, **kw)
      if chunked:
        return self._chunked_tail(x, y, drop, mlp, train)
      x = x + drop(y, deterministic=not train)
      return x + drop(
          mlp(self._apply(norm2, x, mask), deterministic=not train), deterministic=not train
      )
    y = attn(x, memory=memory, **kw)
    if chunked:
      return self._chunked_tail(x, y, drop, mlp, train)
    x = self._apply(norm1, x + drop(y, deterministic=not train), mask)
    y = mlp(x, deterministic=not train)
    return self._apply(norm2, x + drop(y, deterministic=not train), mask)

  def _chunked(self, x, decode) -> bool:
    """Whether this call runs its token-wise part by chunks: ``mlp_chunk`` set, not decoding
    or initialising (init builds the parameters through the whole-sequence path), and more
    than one chunk in a device's block of the sequence."""
    if not self.mlp_chunk or decode is not None or self.is_initializing():
      return False
    return -(-x.shape[1] // context_parallel.seq_size()) > self.mlp_chunk

  def _fused(self, attn, x, memory, decode, reference) -> bool:
    """Whether the token-wise part runs inside the attention's chunk loop (the block calls
    ``chunked_attention.attend`` with ``_tail``): post-norm, ``attention.attn_chunk`` equal
    to ``mlp_chunk``, and the attention call running by chunks."""
    if self.norm != "post" or self.attention.attn_chunk != self.mlp_chunk:
      return False
    return attn.by_chunks(x, memory, decode, reference)

  def _chunked_tail(self, x, y, drop, mlp, train):
    """``x [b, N, D]`` the block's input and ``y`` its attention output -> the block's output,
    computed by ``tokenwise.map_chunks`` (``_tail``)."""
    return tokenwise.map_chunks(
        self._tail(x, drop, mlp, train), (x, y), self.mlp_chunk, context_parallel.seq_size()
    )

  def _tail(self, x, drop, mlp, train):
    """The block's token-wise part as ``fn(pos, x_chunk, y_chunk) -> out_chunk`` (chunks
    ``[b, P, C, D]`` of the block input and attention output, ``pos`` the tokens' positions),
    from the parameters of the whole-sequence path's modules (same math: their own
    ``apply``) and slices of its dropout masks (same keys, drawn in the same order)."""
    det = not train
    keys = (drop.key(deterministic=det), mlp(None, deterministic=det, key_only=True))
    keys += (drop.key(deterministic=det),)
    # Promoted once, outside the chunk loop: a float64 model sums its float32 parameters'
    # gradients over the chunks in float64, as the whole-sequence dot does.
    p = jax.tree.map(
        lambda a: a.astype(jnp.promote_types(a.dtype, self.dtype)), self.variables["params"]
    )
    b, n, d = x.shape
    keep = 1.0 - self.dropout_rate

    def bound(module, params):  # an unbound module's own math on its parameters in p
      return functools.partial(module.apply, {"params": params})

    ln1 = bound(nn.LayerNorm(dtype=self.dtype, parent=None), p["norm_attention"])
    ln2 = bound(nn.LayerNorm(dtype=self.dtype, parent=None), p["norm_mlp"])
    fc1 = bound(nn.Dense(self.mlp_dim, dtype=self.dtype, parent=None), p["mlp"]["fc1"])
    fc2 = bound(nn.Dense(d, dtype=self.dtype, parent=None), p["mlp"]["fc2"])

    def tail(pos, xc, yc):
      def dropped(v, key):
        if key is None:
          return v
        index = (jnp.arange(b)[:, None, None, None], pos, jnp.arange(v.shape[-1])[None, None, None])
        mask = tokenwise.bernoulli_at(key, keep, (b, n, v.shape[-1]), index)
        return masked_scale(v, mask, keep)

      def mlp_fn(h):
        return fc2(dropped(nn.gelu(fc1(h)), keys[1]))

      if self.norm == "pre":
        x1 = xc + dropped(yc, keys[0])
        return x1 + dropped(mlp_fn(ln2(x1)), keys[2])
      x1 = ln1(xc + dropped(yc, keys[0]))
      return ln2(x1 + dropped(mlp_fn(x1), keys[2]))

    return tail


class Layer(Block):
  """A ``Block`` whose call settings are fields and whose arguments are arrays (or None): the
  body that ``nn.remat`` and ``nn.scan`` wrap (a traced argument cannot steer Python control
  flow). Same parameters as ``Block``. ``__call__(x, mask, memory, memory_mask, offset,
  index=None)`` -> ``(y, new_memory)``: ``new_memory`` is the layer's Transformer-XL memory for
  the next segment (its input appended to ``memory``, the last M kept, stop-gradient; None
  without memory); ``offset`` is the decoding slot when ``decoding``
  (``fastpos.models.decoding``). Under ``nn.scan``, ``index`` is the iteration (int32 scalar)
  and ``unrolled_names`` the name each iteration has in the unrolled model: fixed random draws
  (a random-feature projection, SPE's noise) are keyed by that name
  (``fastpos.positional.path_keys``), so every scanned layer draws what its unrolled twin does."""

  train: bool = False
  reference: bool = False
  decoding: bool = False
  cache_length: int | None = None
  unrolled_names: tuple[str, ...] = ()

  @nn.compact
  def __call__(self, x, mask, memory, memory_mask, offset, index=None):
    new_memory = None
    if memory is not None:
      new_memory = jax.lax.stop_gradient(
          jnp.concatenate([memory, x.astype(memory.dtype)], axis=1)[:, -memory.shape[1] :]
      )
    decode = None
    if self.decoding:
      decode = decoding.Step(offset=offset, cache_length=self.cache_length)
    scanned = contextlib.nullcontext()
    if index is not None:
      scanned = path_keys.scanned_layer(self.scope.path, self.unrolled_names, index)
    with scanned:
      y = self._forward(
          x, mask, self.attention.grid, memory, memory_mask, self.train, self.reference, decode
      )
    return y, new_memory
