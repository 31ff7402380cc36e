"""The models: encoder classifier, dual encoder (LRA Retrieval) and causal decoder LM.

All share one ``Tower`` (embedding-hook schemes -> blocks -> final norm for pre-LN) and one
``Block``; the kernel and the positional schemes live in the ``AttentionConfig``. Inputs are a
batch dict: ``inputs`` int32 ``[b, N]`` (0 = padding), ``mask`` bool ``[b, N]`` (True for real
tokens; ``inputs != 0`` when absent; a mask of another dtype or shape raises ValueError, it is
never cast), plus ``inputs2`` / ``mask2`` for retrieval. ``Classifier`` and ``DecoderLM`` also
take the ids alone, ``model.apply(variables, ids, mask=mask)`` with ``ids`` int ``[b, N]``.
Image tasks' grid is static (the task's ``TaskInfo.grid``), not part of the batch.

One call convention: ``Attention``, ``Block``, ``Tower`` and the models take the input first
and everything else by keyword (``mask=``, ``train=``); ``Attention``, ``Block`` and ``Tower``
return an array (``Tower`` a pair only when given ``memory``).
"""

from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from fastpos import positional
from fastpos.models import decoding
from fastpos.models.attention import AttentionConfig, add_batch_axis, check_input
from fastpos.models.blocks import Dropout, Layer, check_stack, remat_policy
from fastpos.ops import segments
from fastpos.ops.masks import check_mask

POOLINGS = ("mean", "cls")


def _mask_or_ones(batch, key_inputs: str, key_mask: str):
  """``(inputs, mask)``: the batch's boolean mask (checked against the inputs' shape; any other
  dtype raises ValueError, never a cast), or ``inputs != 0`` when the batch has none."""
  inputs = batch[key_inputs]
  mask = batch.get(key_mask)
  if mask is None:
    return inputs, inputs != 0
  return inputs, check_mask(
      mask,
      jnp.shape(inputs),
      name=f"batch[{key_mask!r}]",
      against=f"batch[{key_inputs!r}] of shape {jnp.shape(inputs)}",
  )


def as_batch(model: str, batch, mask):
  """The model's batch dict: ``batch`` itself (a dict holding ``inputs``), or ``{"inputs":
  batch, "mask": mask}`` for bare token ids ``batch`` int ``[b, N]``. Raises ValueError naming
  what to pass otherwise."""
  what = (
      f"{model} takes token ids int [batch, length] (and mask= bool [batch, length]) or a "
      "batch dict {'inputs': ids, 'mask': mask}"
  )
  if isinstance(batch, Mapping):
    if mask is not None:
      raise ValueError(f"{model}: mask= given beside a batch dict; put it in the dict as 'mask'.")
    if "inputs" not in batch:
      raise ValueError(f"{what}; got a dict with keys {sorted(batch)}.")
    return batch
  shape, dtype = jnp.shape(batch), jnp.result_type(batch)
  if len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer) or shape[1] == 0:
    raise ValueError(f"{what}; got {dtype} of shape {shape}.")
  return {"inputs": batch} if mask is None else {"inputs": batch, "mask": mask}


def block_name(i: int) -> str:
  """The name of the unrolled model's layer ``i`` (its variables and its module path)."""
  return f"block_{i}"


def stack_layers(tree, num_layers: int):
  """A variables tree (params, batch_stats, cache) of the unrolled layout (``block_0`` ...
  ``block_{L-1}``) in the ``scan_layers`` layout (``layers``, every leaf stacked on a leading
  axis of L), e.g. to load an unrolled checkpoint into a scanned model."""
  if not isinstance(tree, Mapping):
    return tree
  names = [block_name(i) for i in range(num_layers)]
  out = {k: stack_layers(v, num_layers) for k, v in tree.items() if k not in names}
  if all(n in tree for n in names):
    out["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *(tree[n] for n in names))
  return out


def unstack_layers(tree, num_layers: int):
  """The inverse of ``stack_layers``: ``layers`` split into ``block_0`` ... ``block_{L-1}``."""
  if not isinstance(tree, Mapping):
    return tree
  out = {k: unstack_layers(v, num_layers) for k, v in tree.items() if k != "layers"}
  if "layers" in tree:
    out.update(
        {
            block_name(i): jax.tree.map(lambda a, i=i: a[i], tree["layers"])
            for i in range(num_layers)
        }
    )
  return out


class Tower(nn.Module):
  """``x [b, N, D]`` embeddings -> ``[b, N, D]`` states through ``num_layers`` blocks.

  Called as ``tower(x, mask=None, train=False)``; returns the states ``[b, N, D]`` (an array,
  as ``Block`` and ``Attention`` return), or ``(states, new_memory)`` when given ``memory``
  (Transformer-XL). ``mask`` may also come second by position (older code). One example
  ``x [N, D]`` (``mask [N]``) runs with a batch axis of one.

  Attributes:
    attention: the ``AttentionConfig`` (embed-hook schemes included: the tower runs them on
      ``x`` before the blocks).
    num_layers, mlp_dim, dropout_rate, norm, dtype, mlp_chunk: as ``Block``'s.
    remat, scan_layers: below.

  Example::

      cfg = fastpos.attention_config(32, 4, kernel="elu1", positional="rope,fastrpb")
      tower = fastpos.Tower(cfg, num_layers=2, mlp_dim=64)
      x = jnp.ones((2, 10, 32))                          # [batch, N, D] float32
      variables = jax.jit(tower.init)(jax.random.key(0), x)     # jitted: one program
      states = jax.jit(tower.apply)(variables, x, mask=jnp.ones((2, 10), bool))   # [2, 10, 32]

  ``remat`` (``blocks.REMAT_POLICIES``): what each block keeps for its backward pass.
  ``scan_layers``: the blocks run as one ``nn.scan`` body (parameters under ``layers``, stacked
  on a leading axis; ``stack_layers`` converts an unrolled tree): compile time flat in depth,
  and the only form in which XLA:CPU honours the remat policy (unrolled, it schedules the
  recomputation away). The scanned model is the unrolled one: given ``stack_layers`` of its
  parameters it computes the same outputs and gradients. Fixed random draws keyed by a
  layer's path (the random-feature kernels' projections, SPE's noise) are keyed by the path
  the layer has unrolled (``.../block_{i}/...``; ``fastpos.positional.path_keys``), so each
  layer draws what the unrolled layer i draws; the ``dropout`` and ``features`` (redrawn
  projections) streams are split per layer, so each layer gets its own masks and redraws,
  though not the unrolled model's (those follow the module path). Schemes shared across
  layers are refused with it. ``mlp_chunk``: each block's token-wise part over chunks of that
  many tokens (``Block``; 0: whole sequence)."""

  attention: AttentionConfig
  num_layers: int
  mlp_dim: int
  dropout_rate: float = 0.0
  norm: str = "post"
  dtype: Any = jnp.float32
  remat: str = "none"
  scan_layers: bool = False
  mlp_chunk: int = 0

  def _layer_class(self, decoding: bool):
    """``Layer``, under ``nn.remat`` with the ``remat`` policy unless "none" or decoding."""
    policy = remat_policy(self.remat)
    if self.remat == "none" or decoding:
      return Layer
    return nn.remat(Layer, policy=policy)

  def _scanned(self, settings: dict, decoding: bool):
    """The layers as one ``nn.scan`` body, parameters (and batch statistics, decoding caches)
    stacked on a leading layer axis under ``layers``: ``(x, mask, memory [L, b, M, D] or
    None, memory_mask, offset, index [L] int32) -> (x, new memory [L, b, M, D] or None)``.
    ``index`` (``arange(L)``) and the unrolled names key each layer's fixed random draws by
    its unrolled path (``Layer``); the ``dropout`` and ``features`` (redrawn projections)
    streams are split per layer."""
    scan = nn.scan(
        self._layer_class(decoding),
        variable_axes={"params": 0, "batch_stats": 0, "cache": 0},
        split_rngs={"params": True, "dropout": True, "features": True},
        in_axes=(nn.broadcast, 0, nn.broadcast, nn.broadcast, 0),
        length=self.num_layers,
    )
    names = tuple(block_name(i) for i in range(self.num_layers))
    return scan(**settings, unrolled_names=names, name="layers")

  def __post_init__(self):
    check_stack(
        "Tower",
        mlp_dim=self.mlp_dim,
        dropout_rate=self.dropout_rate,
        norm=self.norm,
        num_layers=self.num_layers,
        mlp_chunk=self.mlp_chunk,
    )
    super().__post_init__()

  @nn.compact
  def __call__(
      self,
      x,
      mask=None,
      *,
      train: bool = False,
      reference: bool = False,
      memory=None,
      decode=None,
  ):
    """``mask``: ``[b, N]`` bool, True for real tokens. ``memory``: ``(states, memory_mask)``
    with a list of per-layer ``[b, M, D]`` states (each layer's input over the previous
    segments; Transformer-XL) and a bool ``[b, M]`` True where a real token sits, or None.
    Masks of any other dtype or shape raise ValueError. Returns the states ``[b, N, D]``, or
    ``(states, new_memory)`` when given ``memory``. ``decode``: a
    ``fastpos.models.decoding.Step`` (x holds new tokens at slots ``decode.offset + i``; no
    memory)."""
    if check_input("Tower", x, self.attention.embed_dim):  # one example: a batch axis of one
      if memory is not None:
        raise ValueError("Tower: memory needs a batched x [batch, length, embed_dim].")
      x, mask, _, _ = add_batch_axis("Tower", x, mask)
      return self._run(x, mask, train, reference, None, decode)[0]
    return self._run(x, mask, train, reference, memory, decode)

  def _run(self, x, mask, train, reference, memory, decode):
    """The tower on a batched ``x`` (called from the compact ``__call__``)."""
    mask = check_mask(mask, x.shape[:2], against=f"x of shape {x.shape}")
    if memory is not None and mask is None:  # the new memory's mask appends this one
      mask = jnp.ones(x.shape[:2], bool)
    if memory is not None and decode is not None:
      raise ValueError("Tower: a decoding step reads the cache, not memory; pass one of them.")
    if memory is not None:
      states, mmask = memory
      if len(states) != self.num_layers:
        raise ValueError(
            f"Tower: memory holds {len(states)} states; one per layer "
            f"({self.num_layers}) is needed."
        )
      m_shape = jnp.shape(states[0]) if states else (x.shape[0], None)
      memory = (
          states,
          check_mask(
              mmask,
              (x.shape[0], m_shape[1]),
              name="memory_mask",
              layout="[batch, M]",
              against=f"memory states {m_shape}",
          ),
      )
    cfg = self.attention
    grid = cfg.grid
    ctx = positional.Context(
        mask=mask,
        grid=grid,
        causal=cfg.causal,
        length=x.shape[1],
        deterministic=not train,
        reference=reference,
        offset=None if decode is None else decode.offset,
    )
    dims = cfg.scheme_dims()
    for spec in cfg.positional:
      if "embed" in spec.cls.hooks:
        scheme = positional.build(
            spec.name, dims[spec.name], spec.option_dict(), name=f"pos_{spec.name}"
        )
        x = scheme.embed(x, ctx)
    shared = tuple(
        positional.build(
            spec.name, dims[spec.name], spec.option_dict(), name=f"pos_{spec.name}_shared"
        )
        for spec in cfg.positional
        if spec.option_dict().get("share_across_layers")
    )
    cfg = cfg.attention_only()  # the embed hook ran above; the blocks run the others
    x = Dropout(self.dropout_rate)(x, deterministic=not train)
    states, mmask = memory if memory is not None else (None, None)
    settings = dict(
        attention=cfg,
        mlp_dim=self.mlp_dim,
        dropout_rate=self.dropout_rate,
        norm=self.norm,
        shared=shared,
        dtype=self.dtype,
        mlp_chunk=self.mlp_chunk,
        train=train,
        reference=reference,
        decoding=decode is not None,
        cache_length=None if decode is None else decode.cache_length,
    )
    offset = None if decode is None else decode.offset
    if self.scan_layers:
      x, new_states = self._scanned(settings, decode is not None)(
          x,
          mask,
          None if states is None else jnp.stack(states),
          mmask,
          offset,
          jnp.arange(self.num_layers, dtype=jnp.int32),
      )
      new_states = None if states is None else list(new_states)
    else:
      layer = self._layer_class(decode is not None)
      new_states = [] if memory is not None else None
      for i in range(self.num_layers):
        x, new = layer(**settings, name=block_name(i))(
            x, mask, None if states is None else states[i], mmask, offset
        )
        if new_states is not None:
          new_states.append(new)
    if self.norm == "pre":
      x = nn.LayerNorm(dtype=self.dtype, name="final_norm")(x)
    if memory is None:
      return x
    m_len = mmask.shape[1]
    new_mask = jnp.concatenate([mmask, mask], axis=1)[:, -m_len:]
    return x, (new_states, new_mask)


class _Base(nn.Module):
  attention: AttentionConfig
  vocab_size: int
  num_layers: int
  mlp_dim: int
  dropout_rate: float = 0.0
  norm: str = "post"
  pooling: str = "mean"
  num_classes: int = 0
  dtype: Any = jnp.float32
  remat: str = "none"
  scan_layers: bool = False
  mlp_chunk: int = 0

  def __post_init__(self):
    name = type(self).__name__
    check_stack(
        name,
        mlp_dim=self.mlp_dim,
        dropout_rate=self.dropout_rate,
        norm=self.norm,
        num_layers=self.num_layers,
        mlp_chunk=self.mlp_chunk,
    )
    if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
      raise ValueError(f"{name}: vocab_size must be an int >= 1; got {self.vocab_size!r}.")
    if self.pooling not in POOLINGS:
      raise ValueError(
          f"{name}: unknown pooling {self.pooling!r}; valid choices: " f"{', '.join(POOLINGS)}."
      )
    self._check_head()
    super().__post_init__()

  def _check_head(self):
    """The encoders' head: ``num_classes >= 2``; the CLS token breaks an image grid."""
    name = type(self).__name__
    if not isinstance(self.num_classes, int) or self.num_classes < 2:
      raise ValueError(f"{name}: num_classes must be an int >= 2; got {self.num_classes!r}.")
    if self.pooling == "cls" and self.attention.grid is not None:
      raise ValueError(
          f"{name}: pooling='cls' prepends a token, which breaks the image grid "
          f"{self.attention.grid}; use pooling='mean'."
      )

  def _tower(self, name="encoder"):
    return Tower(
        self.attention,
        self.num_layers,
        self.mlp_dim,
        self.dropout_rate,
        self.norm,
        dtype=self.dtype,
        remat=self.remat,
        scan_layers=self.scan_layers,
        mlp_chunk=self.mlp_chunk,
        name=name,
    )

  def _embed(self):
    return nn.Embed(
        self.vocab_size,
        self.attention.embed_dim,
        embedding_init=nn.initializers.normal(stddev=1.0),
        name="embed",
    )

  def _cls_token(self):
    """The learned CLS token ``[1, 1, D]`` (one per model, shared by both towers of the dual
    encoder), or None with mean pooling."""
    if self.pooling != "cls":
      return None
    return self.param("cls", nn.initializers.normal(stddev=0.02), (1, 1, self.attention.embed_dim))

  def _encode(self, embed, tower, cls, inputs, mask, train, reference):
    """Embeds, runs the tower, pools (masked mean or CLS) -> ``[b, D]``."""
    x = embed(inputs).astype(self.dtype)
    if cls is not None:
      x = jnp.concatenate(
          [jnp.broadcast_to(cls, (x.shape[0], 1, x.shape[-1])).astype(x.dtype), x], axis=1
      )
      mask = jnp.concatenate([jnp.ones((mask.shape[0], 1), bool), mask], axis=1)
    y = tower(x, mask=mask, train=train, reference=reference)
    if cls is not None:
      return y[:, 0]
    w = mask.astype(y.dtype)[..., None]
    return jnp.sum(y * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1)

  def _head(self, x, name="head"):
    """LRA's classifier head: Dense(mlp_dim) -> ReLU -> Dense(num_classes), float32 logits
    (float64 in a float64 model)."""
    x = nn.relu(nn.Dense(self.mlp_dim, dtype=self.dtype, name=f"{name}_hidden")(x))
    out = jnp.promote_types(self.dtype, jnp.float32)  # float64 in a float64 model (tests)
    return nn.Dense(self.num_classes, dtype=self.dtype, name=f"{name}_out")(x).astype(out)


class Classifier(_Base):
  """Encoder classifier: embed -> blocks -> pooling -> head. Returns float32 logits
  ``[b, num_classes]``.

  Called as ``model.apply(variables, batch, train=False)`` with ``batch`` a dict (``inputs``
  int ``[b, N]``, 0 = padding; ``mask`` bool ``[b, N]``, default ``inputs != 0``) or the ids
  alone: ``model.apply(variables, ids, mask=mask)``.

  Attributes:
    attention: the ``AttentionConfig`` (``fastpos.attention_config``).
    vocab_size: V, token ids 0..V-1 (0 is padding).
    num_layers, mlp_dim, dropout_rate, norm, dtype, remat, scan_layers, mlp_chunk: as
      ``Tower``'s.
    pooling: ``"mean"`` over real tokens or ``"cls"`` (a prepended learned token).
    num_classes: >= 2.

  Example::

      cfg = fastpos.attention_config(32, 4, kernel="elu1", positional="fastrpb",
                                     max_length=16)
      model = fastpos.Classifier(cfg, vocab_size=50, num_layers=2, mlp_dim=64, num_classes=3)
      ids = jnp.ones((2, 16), jnp.int32)                 # [batch, N] int token ids
      variables = jax.jit(model.init)(jax.random.key(0), ids)   # jitted: one program
      logits = jax.jit(model.apply)(variables, ids)      # [2, 3] float32

  A packed batch (``fastpos.train.packing``) holds several examples per row: ``segment_ids``
  and ``positions`` ``[b, N]`` int32 and ``segment_mask`` ``[b, S]`` bool (True where slot s
  holds an example); with ``pooling="cls"`` each segment's position-0 slot takes the CLS
  token. Each segment is pooled alone: returns ``[b, S, num_classes]`` (empty slots' logits
  are those of a zero vector, never read)."""

  @nn.compact
  def __call__(self, batch, *, mask=None, train: bool = False, reference: bool = False):
    batch = as_batch("Classifier", batch, mask)
    inputs, mask = _mask_or_ones(batch, "inputs", "mask")
    if batch.get("segment_ids") is not None:
      return self._head(self._packed(batch, inputs, mask, train, reference))
    pooled = self._encode(
        self._embed(), self._tower(), self._cls_token(), inputs, mask, train, reference
    )
    return self._head(pooled)

  def _packed(self, batch, inputs, mask, train, reference):
    """A packed batch's per-segment pooled states ``[b, S, D]``."""
    ids, positions = batch["segment_ids"], batch.get("positions")
    slots = batch.get("segment_mask")
    if slots is None or positions is None:
      raise ValueError(
          "a packed classification batch needs 'positions' and 'segment_mask' beside "
          "'segment_ids' (fastpos.train.packing)."
      )
    x = self._embed()(inputs).astype(self.dtype)
    cls = self._cls_token()
    member = ids[..., None] == jnp.arange(1, slots.shape[1] + 1)[None, None]  # [b, N, S]
    if cls is not None:  # the CLS token sits in each segment's first slot
      first = (positions == 0) & (ids > 0)
      x = jnp.where(first[..., None], jnp.broadcast_to(cls.astype(x.dtype), x.shape), x)
      mask = mask | first
      member = member & first[..., None]
    else:
      member = member & mask[..., None]
    with segments.packed(ids, positions):
      y = self._tower()(x, mask=mask, train=train, reference=reference)
    w = member.astype(y.dtype)
    total = jnp.einsum("bns,bnd->bsd", w, y, precision=jax.lax.Precision.HIGHEST)
    pooled = total / jnp.maximum(jnp.sum(w, axis=1), 1)[..., None]
    return jnp.where(slots[..., None], pooled, jnp.zeros((), pooled.dtype))


class DualEncoder(_Base):
  """LRA Retrieval: one shared tower encodes both documents; the head sees
  ``[u, v, u*v, u-v]``. Returns float32 logits ``[b, num_classes]``.

  Called as ``model.apply(variables, batch, train=False)`` with ``batch`` a dict: ``inputs``
  and ``inputs2`` int ``[b, N]`` (the two documents, 0 = padding), optional ``mask`` /
  ``mask2`` bool ``[b, N]``. Attributes as ``Classifier``'s.

  Example::

      cfg = fastpos.attention_config(32, 4, kernel="elu1", max_length=16)
      model = fastpos.DualEncoder(cfg, vocab_size=50, num_layers=1, mlp_dim=64, num_classes=2)
      batch = {"inputs": jnp.ones((2, 16), jnp.int32), "inputs2": jnp.ones((2, 16), jnp.int32)}
      variables = jax.jit(model.init)(jax.random.key(0), batch)   # jitted: one program
      logits = jax.jit(model.apply)(variables, batch)    # [2, 2] float32
  """

  @nn.compact
  def __call__(self, batch, *, train: bool = False, reference: bool = False):
    if not isinstance(batch, Mapping) or "inputs2" not in batch:
      raise ValueError(
          "DualEncoder takes a batch dict with both documents: {'inputs': ids, 'inputs2': "
          "ids2} (int [batch, length] each; optional 'mask' / 'mask2' bool); got "
          f"{type(batch).__name__}"
          + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
          + "."
      )
    embed, tower = self._embed(), self._tower()
    in1, m1 = _mask_or_ones(batch, "inputs", "mask")
    in2, m2 = _mask_or_ones(batch, "inputs2", "mask2")
    cls = self._cls_token()
    u = self._encode(embed, tower, cls, in1, m1, train, reference)
    v = self._encode(embed, tower, cls, in2, m2, train, reference)
    return self._head(jnp.concatenate([u, v, u * v, u - v], axis=-1))


class DecoderLM(_Base):
  """Causal decoder LM: ``[b, L]`` ids -> ``[b, L, vocab]`` next-token logits.

  Called as ``model.apply(variables, ids, mask=None, train=False)`` with ``ids`` int ``[b,
  L]`` (0 = padding; ``mask`` bool ``[b, L]``, default ``ids != 0``), or with a batch dict
  ``{"inputs": ids, "mask": mask}`` (what the trainer passes; a packed batch adds
  ``segment_ids`` and ``positions``). Returns float32 logits ``[b, L, vocab_size]`` (logit i
  predicts token i + 1), or ``(logits, new_memory)`` with ``memory_length > 0``.

  Attributes:
    attention: a causal ``AttentionConfig`` (``fastpos.attention_config(..., causal=True)``;
      a bidirectional one is refused).
    vocab_size: V, token ids 0..V-1 (0 is padding, never sampled by ``fastpos.generate``).
    num_layers: blocks (>= 1).
    mlp_dim: each block's MLP hidden width.
    dropout_rate: in [0, 1) (default 0).
    norm: ``"post"`` (default), ``"pre"`` (GPT: a final LayerNorm) or ``"batch"``.
    dtype: activation dtype (parameters float32; logits float32).
    remat, scan_layers, mlp_chunk: memory and compile-time settings (``Tower``).
    tie_embeddings: output projection = the embedding transposed (below); default True.
    memory_length: M > 0: Transformer-XL memory (below); default 0.

  Example::

      cfg = fastpos.attention_config(32, 4, kernel="elu1", positional="rope", causal=True,
                                     max_length=64)
      model = fastpos.DecoderLM(cfg, vocab_size=100, num_layers=2, mlp_dim=64)
      ids = jnp.ones((2, 16), jnp.int32)                 # [batch, L] int token ids
      variables = jax.jit(model.init)(jax.random.key(0), ids)   # jitted: one program
      logits = jax.jit(model.apply)(variables, ids)      # [2, 16, 100] float32
      tokens = fastpos.generate(model, variables["params"], ids[:1, :4], num_tokens=5)  # [1, 5]

  ``tie_embeddings``: the output projection is the input embedding transposed, times a learned
  scalar ``logit_scale`` initialised to ``1 / embed_dim``. The final states are layer-normalised
  (norm sqrt(D)) and the embedding rows have unit-variance entries (norm sqrt(D)), so a logit is
  ``cos * D * scale``. Unscaled, the input token's own row, which the residual path keeps
  (cos ~0.7 after a layer), gets a logit of ~0.7 D: a first loss of hundreds of nats at width
  512. A fixed ``D ** -0.5`` (T5, Flax lm1b) still leaves it at ~0.7 sqrt(D); ``1 / D`` makes
  every logit O(1) and the first loss ~ln(vocab) at every width, and the scale is learned (one
  scalar, no weight decay) so that it grows as fast as the model needs. Untied, the head's
  LeCun init gives logits of std ~1 (first loss ~ln(vocab) + 0.5).
  ``memory_length`` M > 0 (Transformer-XL): ``memory`` is ``(states, memory_mask)``, a list
  of per-layer ``[b, M, D]`` states and ``[b, M]`` True for real tokens; ``init_memory`` gives
  an empty one (all masked), used when ``memory`` is None. Returns ``(logits, new_memory)``:
  feed ``new_memory`` to the next segment (it is stop-gradient).
  ``decode=True``: incremental decoding from the ``cache`` collection (``init_cache``;
  ``fastpos.models.decoding``); returns the new tokens' logits only.
  """

  tie_embeddings: bool = True
  memory_length: int = 0

  def _check_head(self):
    """An LM is causal by construction and has no pooling or classes: refuse what it would
    ignore (a bidirectional attention config would let every token see the future)."""
    if not self.attention.causal:
      raise ValueError(
          "DecoderLM: the attention config is bidirectional (causal=False), so "
          "every position would see the tokens it predicts; build it with "
          "AttentionConfig(..., causal=True)."
      )
    if self.pooling != "mean" or self.num_classes != 0:
      raise ValueError(
          f"DecoderLM: pooling and num_classes are encoder fields; leave them at "
          f"their defaults ('mean', 0); got pooling={self.pooling!r}, "
          f"num_classes={self.num_classes!r}."
      )
    if not isinstance(self.memory_length, int) or self.memory_length < 0:
      raise ValueError(
          f"DecoderLM: memory_length must be an int >= 0 (0: no memory); got "
          f"{self.memory_length!r}."
      )

  def init_cache(self, batch_size: int, max_length: int):
    """An empty decoding state (the ``cache`` collection) for ``batch_size`` rows of at most
    ``max_length`` tokens (``fastpos.models.decoding``): zeros, shaped without any compute."""
    if max_length < 1 or max_length > self.attention.max_length:
      raise ValueError(
          f"init_cache: max_length must be in [1, {self.attention.max_length}] "
          f"(the model's max_length); got {max_length}."
      )
    batch = {
        "inputs": jnp.zeros((batch_size, 1), jnp.int32),
        "mask": jnp.ones((batch_size, 1), bool),
    }
    shapes = jax.eval_shape(
        lambda: self.init(jax.random.key(0), batch, decode=True, cache_length=max_length)
    )
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes["cache"])

  def init_memory(self, batch_size: int):
    states = [
        jnp.zeros((batch_size, self.memory_length, self.attention.embed_dim), self.dtype)
        for _ in range(self.num_layers)
    ]
    return states, jnp.zeros((batch_size, self.memory_length), bool)

  @nn.compact
  def __call__(
      self,
      batch,
      *,
      mask=None,
      train: bool = False,
      reference: bool = False,
      memory=None,
      decode: bool = False,
      cache_length: int | None = None,
  ):
    batch = as_batch("DecoderLM", batch, mask)
    if decode:
      if memory is not None:
        raise ValueError("DecoderLM: decode=True reads the cache; memory is not used there.")
      return self._decode(batch, train=train, reference=reference, cache_length=cache_length)
    if cache_length is not None:
      raise ValueError(f"DecoderLM: cache_length={cache_length!r} is for decode=True only.")
    if self.memory_length and memory is None:
      memory = self.init_memory(batch["inputs"].shape[0])
    if not self.memory_length and memory is not None:
      raise ValueError("memory given but memory_length is 0.")
    inputs, mask = _mask_or_ones(batch, "inputs", "mask")
    embed = self._embed()
    x = embed(inputs).astype(self.dtype)
    with segments.packed(batch.get("segment_ids"), batch.get("positions")):
      if memory is None:
        y, new_memory = self._tower()(x, mask=mask, train=train, reference=reference), None
      else:
        y, new_memory = self._tower()(x, mask=mask, train=train, reference=reference, memory=memory)
    logits = self._logits(embed, y)
    return logits if not self.memory_length else (logits, new_memory)

  def _logits(self, embed, y):
    """float32 logits (float64 in a float64 model, so tests can hold paths to 1e-9); the one
    output projection of the full forward and of decoding."""
    out = jnp.promote_types(self.dtype, jnp.float32)
    if self.tie_embeddings:
      scale = self.param(
          "logit_scale", nn.initializers.constant(1 / self.attention.embed_dim), (), jnp.float32
      )
      logits = embed.attend(y.astype(out)) * scale.astype(out)
    else:
      logits = nn.Dense(self.vocab_size, dtype=self.dtype, name="lm_head")(y)
    return logits.astype(out)

  def _decode(self, batch, *, train, reference, cache_length):
    """``decode=True``: the batch's L tokens go to the next L slots of the ``cache`` collection
    (``fastpos.models.decoding``); returns their logits ``[b, L, vocab]`` (no memory)."""
    if train:
      raise ValueError("decoding runs with train=False.")
    inputs, mask = _mask_or_ones(batch, "inputs", "mask")
    if not self.is_initializing() and not self.has_variable("cache", "index"):
      raise ValueError(
          "decoding needs a cache: build it with model.init_cache(batch_size, "
          "max_length) and apply with {'params': ..., 'cache': cache}, "
          "mutable=['cache']."
      )
    index = self.variable("cache", "index", jnp.zeros, (), jnp.int32)
    step = decoding.Step(offset=index.value, cache_length=cache_length)
    embed = self._embed()
    x = embed(inputs).astype(self.dtype)
    y = self._tower()(x, mask=mask, train=False, reference=reference, decode=step)
    index.value = index.value + inputs.shape[1]
    return self._logits(embed, y)
