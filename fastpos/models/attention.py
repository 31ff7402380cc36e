"""One attention layer for every kernel x positional scheme.

``Attention`` projects x to q, k, v and hands them to the hook dispatcher
(``fastpos.models.hooks.run``), which calls each positional scheme at its hooks (README
"Design", "The five hooks") in one order without knowing which scheme it talks to: ``features``
(pre_phi) on q, k; then softmax (``features`` post_phi, logits bias = ``logits`` hooks + the
``kv`` tables materialised as b_{j-i} + a decay as (i-j) log r, exact softmax) or a linear
kernel (phi, ``features`` post_phi, ``kv`` tables -> ``rpe = exp(sum of b)`` by FFT, decays ->
the chunked causal path); then the ``output`` terms (FastRPB's W V); then the output projection.
This module's ``FullPath`` says where the full forward's keys and values come from and which
ops attend; a decoding step uses ``fastpos.models.decoding.StepPath`` through the same
dispatcher. Causal sikf / favor / orf / prf layers without a table, a decay or a
sign-changing post_phi scheme pass their keys split as ``e exp(s) + eps`` (``scaled_keys``), so
the scan keeps a running maximum of s and no late key can overflow the stabiliser (the sequence
split over devices keeps the first-key stabiliser).

Precision: projections run in ``dtype`` (e.g. bfloat16) with float32 parameters. What stays
float32 (float64 in float64 runs): the feature maps' exponentials, the linear-attention states
``sum phi(k) v^T`` and denominators and every FFT (``fastpos.ops`` compute there in float32,
because bf16's 8-bit mantissa loses the small terms of long sums and FFT round-off grows with
log N), and softmax's normaliser (``jax.nn.dot_product_attention`` takes softmax in float32).
Results are cast back to ``dtype``.

With ``reference=True`` every fast path is replaced by its dense O(N^2) reference (materialised
attention and Toeplitz matrices); tests hold the two together.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import flax.linen as nn
import jax.numpy as jnp
import ml_collections

from fastpos import positional
from fastpos.models import chunked_attention as chunked
from fastpos.models import context_parallel as cp
from fastpos.models import decoding
from fastpos.models import hooks as hooks_lib
from fastpos.ops import attention as attn_ops
from fastpos.ops import features as feature_ops
from fastpos.ops import segments, toeplitz
from fastpos.ops.masks import check_mask
from fastpos.positional import compatibility, path_keys
from fastpos.tasks.info import TaskInfo

# The kernel and its options: the one kernel record (``fastpos.ops.features.Kernel``), under
# the name models use: ``KernelSpec(name, num_features=..., nu=..., eps=..., redraw=...,
# seed=...)`` and ``KernelSpec.from_config(name, options)``.
KernelSpec = feature_ops.Kernel


@dataclasses.dataclass(frozen=True)
class PositionalSpec:
  """A scheme name and its options (a hashable tuple of (key, value) pairs); ``make`` checks
  the option names (values are checked when the layer is built).

  Example::

      spec = fastpos.PositionalSpec.make("fastrpb", {"per_head": True})
      spec.option_dict()                                  # {'per_head': True}
  """

  name: str
  options: tuple = ()

  @classmethod
  def make(cls, name: str, options: Mapping | None = None) -> "PositionalSpec":
    options = dict(options or {})
    positional.check_options(name, options)
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))
    return cls(name, frozen)

  @property
  def cls(self) -> type[positional.Scheme]:
    return positional.get_class(self.name)

  def option_dict(self) -> dict:
    return dict(self.options)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Static description of an attention layer (hashable, so it can be a linen field);
  ``fastpos.attention_config`` builds one from flat keywords, ``from_model_config`` from a
  model config. Bad sizes, names, options and what cannot run (``plan``) raise ValueError at
  construction.

  Attributes:
    num_heads, head_dim, embed_dim: h, d and D (the layer maps ``[b, N, D] -> [b, N, D]``).
    kernel: a ``KernelSpec`` (``fastpos.Kernel``); softmax by default.
    positional: the schemes, in order (``PositionalSpec``).
    max_length: the longest sequence the positional tables serve.
    grid: (H, W) for 2D inputs (N = H * W, raster order), else None.
    causal: query i sees keys j <= i only.
    chunk_size: causal linear attention's chunk (None: chosen by shape).
    attn_chunk: > 0: the layer runs by chunks of this many tokens (memory, not function).

  Example::

      cfg = fastpos.AttentionConfig(num_heads=4, head_dim=8, embed_dim=32, max_length=64,
                                    kernel=fastpos.KernelSpec("elu1"), causal=True,
                                    positional=(fastpos.PositionalSpec.make("rope"),))
      layer = fastpos.Attention(cfg)
      x = jnp.ones((2, 10, 32))                           # [batch, N, D] float32
      y = layer.apply(layer.init(jax.random.key(0), x), x)   # [2, 10, 32]
  """

  num_heads: int
  head_dim: int
  embed_dim: int
  kernel: KernelSpec = KernelSpec()
  positional: tuple[PositionalSpec, ...] = ()
  max_length: int = 512
  grid: tuple[int, int] | None = None
  causal: bool = False
  chunk_size: int | None = None  # None: chosen by shape (ops.attention.causal_chunk_size)
  attn_chunk: int = 0  # > 0: the layer by chunks of this many tokens (models.chunked_attention)
  # Causal linear attention's algorithm (``fastpos.ops.linear_attn``): "auto", "chunk",
  # "recurrent" or "fused"; bidirectional and softmax layers take no other path for it.
  mode: str = "auto"

  def __post_init__(self):
    _check_sizes(self)
    chunked.check_chunk(self.attn_chunk)
    # The config's plan: what a call may add (a split sequence, packing, memory, decoding) is
    # planned again by the call (``plan``).
    self.plan()

  def plan(self, call: compatibility.Setting | None = None) -> compatibility.Plan:
    """What runs (``fastpos.positional.compatibility.plan``) for this config: alone (``call``
    None: its ``attn_chunk``, the sequence's split not known yet), or in the setting of a call,
    ``call`` giving what only the call knows (``seq``, ``packed``, ``memory``, ``decoding``,
    and ``attn_chunk`` if this call runs by chunks, else 0); the config gives causal, 1D / 2D
    and ``mode``. Raises ValueError naming what cannot run."""
    if call is None:
      call = compatibility.Setting(attn_chunk=self.attn_chunk, seq=None)
    setting = dataclasses.replace(
        call, causal=self.causal, two_d=self.grid is not None, mode=self.mode
    )
    return compatibility.plan(
        self.kernel,
        [p.name for p in self.positional],
        setting,
        options={p.name: p.option_dict() for p in self.positional},
    )

  @classmethod
  def from_model_config(cls, cfg, task: TaskInfo) -> "AttentionConfig":
    """The attention description of a model config ``cfg`` (``config.model``) for ``task``
    (its kind, length and grid): what ``fastpos.build_model`` builds the layers from. (The
    public ``fastpos.attention_config`` builds one from flat keywords.)"""
    names = positional.parse_names(cfg.positional)
    opts = _plain(cfg.get("positional_options", None))
    for key in opts:
      if key not in names:
        raise ValueError(
            f"positional_options has options for {key!r}, which is not in model.positional="
            f"{cfg.positional!r}."
        )
    kernel = KernelSpec.from_config(cfg.kernel, _plain(cfg.get("kernel_options", None)))
    if cfg.embed_dim % cfg.num_heads and not cfg.get("head_dim", 0):
      raise ValueError(
          f"embed_dim={cfg.embed_dim} is not divisible by num_heads={cfg.num_heads}; set "
          "head_dim."
      )
    pooling = cfg.get("pooling", "mean")
    # Image tasks: the schemes see the grid (2D positions) unless use_grid=False, which treats
    # the image as its raster sequence (1D schemes; PermuteFormer's "w/o 2D rel. pos.").
    grid = tuple(task.grid) if task.grid is not None and cfg.get("use_grid", True) else None
    if pooling == "cls" and grid is not None:
      raise ValueError(
          "pooling='cls' prepends a token, which breaks the image grid "
          f"{grid}; use pooling='mean' for 2D tasks (or model.use_grid=False)."
      )
    max_length = cfg.get("max_length", 0) or task.max_length
    if max_length <= 0:
      raise ValueError("model.max_length is 0 and the task gives no max_length.")
    if pooling == "cls" and task.kind != "lm":
      max_length += 1
    chunk_size = cfg.get("chunk_size", 0)
    if not isinstance(chunk_size, int) or chunk_size < 0:
      raise ValueError(
          f"model.chunk_size must be an int >= 0 (0 picks it from the shape); got "
          f"{chunk_size!r}."
      )
    return cls(
        num_heads=cfg.num_heads,
        head_dim=cfg.get("head_dim", 0) or cfg.embed_dim // cfg.num_heads,
        embed_dim=cfg.embed_dim,
        kernel=kernel,
        positional=tuple(PositionalSpec.make(n, opts.get(n)) for n in names),
        max_length=max_length,
        grid=grid,
        causal=task.kind == "lm",
        chunk_size=chunk_size or None,
        attn_chunk=cfg.get("attn_chunk", 0),
        mode=cfg.get("attention_mode", "auto"),
    )

  def scheme_dims(self) -> dict[str, positional.Dims]:
    """The Dims each attention-level scheme is built with (feature_dim = the size its
    features hook sees, following pre_phi schemes that change it)."""
    dims, dim = {}, self.head_dim
    stages = [
        p for p in self.positional if "features" in p.cls.hooks and p.cls.feature_stage == "pre_phi"
    ]
    for p in stages:
      dims[p.name] = self._dims(dim)
      dim = p.cls.feature_out_dim(dim, p.option_dict())
    dim = self.kernel.feature_dim(dim)
    for p in self.positional:
      if p.name in dims:
        continue
      dims[p.name] = self._dims(dim)
      if "features" in p.cls.hooks:
        dim = p.cls.feature_out_dim(dim, p.option_dict())
    return dims

  def _dims(self, feature_dim: int) -> positional.Dims:
    return positional.Dims(
        num_heads=self.num_heads,
        head_dim=self.head_dim,
        feature_dim=feature_dim,
        embed_dim=self.embed_dim,
        max_length=self.max_length,
        grid=self.grid,
        causal=self.causal,
        kernel=self.kernel,
    )

  def attention_only(self) -> "AttentionConfig":
    """This config without its embed-hook schemes: what ``Attention`` and ``Block`` take (the
    model's ``Tower`` runs the embed hook on the token embeddings before the blocks)."""
    return dataclasses.replace(
        self, positional=tuple(p for p in self.positional if "embed" not in p.cls.hooks)
    )

  def pre_phi_dim(self) -> int:
    dim = self.head_dim
    for p in self.positional:
      if "features" in p.cls.hooks and p.cls.feature_stage == "pre_phi":
        dim = p.cls.feature_out_dim(dim, p.option_dict())
    return dim


def _plain(options) -> dict:
  """A config block of options (ConfigDict, dict or None) as a plain dict."""
  if options is None:
    return {}
  return options.to_dict() if isinstance(options, ml_collections.ConfigDict) else dict(options)


def _is_int(x, low: int) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _check_sizes(cfg: AttentionConfig) -> None:
  """Raises ValueError naming the first size of ``cfg`` out of its range."""
  for name in ("num_heads", "head_dim", "embed_dim", "max_length"):
    if not _is_int(getattr(cfg, name), 1):
      raise ValueError(
          f"AttentionConfig: {name} must be an int >= 1; got " f"{getattr(cfg, name)!r}."
      )
  if cfg.chunk_size is not None and not _is_int(cfg.chunk_size, 1):
    raise ValueError(
        f"AttentionConfig: chunk_size must be None (chosen by shape) or an int "
        f">= 1; got {cfg.chunk_size!r}."
    )
  if not isinstance(cfg.causal, bool):
    raise ValueError(f"AttentionConfig: causal must be True or False; got {cfg.causal!r}.")
  grid = cfg.grid
  if grid is not None and (
      not isinstance(grid, tuple) or len(grid) != 2 or not all(_is_int(g, 1) for g in grid)
  ):
    raise ValueError(
        f"AttentionConfig: grid must be None (1D) or a tuple (H, W) of ints >= 1; " f"got {grid!r}."
    )


def check_layer_schemes(cfg: AttentionConfig, shared: tuple, layer: str) -> None:
  """Raises ValueError when ``layer`` (``"Attention"`` or ``"Block"``) would not run every
  scheme of ``cfg`` as configured: an embed-hook scheme (the model's ``Tower`` runs that hook),
  a ``share_across_layers`` scheme without its shared module, or a shared module that matches
  no scheme of ``cfg``."""
  embeds = [p.name for p in cfg.positional if "embed" in p.cls.hooks]
  if embeds:
    raise ValueError(
        f"{layer}: positional scheme {embeds[0]!r} acts at the embed hook (on the token "
        f"embeddings), which {layer} does not run: the model's Tower runs it "
        f"(fastpos.models.Tower, inside Classifier, DualEncoder and DecoderLM). Use a Tower, or "
        f"apply the scheme's embed to your embeddings yourself and give {layer} "
        f"cfg.attention_only() (the schemes {layer} runs: "
        f"{', '.join(p.name for p in attention_schemes(cfg)) or 'none'})."
    )
  given = [type(s).scheme_name for s in shared]
  names = [p.name for p in cfg.positional]
  for name in given:
    if name not in names:
      raise ValueError(
          f"{layer}: a shared module for positional scheme {name!r}, which the "
          f"config does not use; its schemes: {', '.join(names) or 'none'}."
      )
  for p in cfg.positional:
    if p.option_dict().get("share_across_layers") and p.name not in given:
      raise ValueError(
          f"{layer}: positional scheme {p.name!r} has share_across_layers=True but {layer} got "
          f"no shared module for it, so each layer would build its own. Build it once and pass "
          f"it as shared=(module,) (Tower does), or set share_across_layers=False."
      )


def check_input(layer: str, x, embed_dim: int) -> bool:
  """Raises ValueError, one line naming ``layer``, unless ``x`` is float ``[batch, length,
  embed_dim]`` or, one example (e.g. under a per-example ``jax.vmap``), ``[length,
  embed_dim]``, with length >= 1. Returns whether ``x`` is the unbatched form (the layer then
  adds a batch axis of one and removes it from its output: ``add_batch_axis``)."""
  shape = tuple(jnp.shape(x))
  want = (
      f"[batch, length, embed_dim] (or [length, embed_dim] for one example), embed_dim={embed_dim}"
  )
  if len(shape) not in (2, 3):
    raise ValueError(f"{layer}: x must be {want}; got shape {shape} (rank {len(shape)}).")
  if shape[-1] != embed_dim:
    raise ValueError(
        f"{layer}: x's last axis is {shape[-1]}, but the layer was built for "
        f"embed_dim={embed_dim}; x must be {want}; got shape {shape}."
    )
  if shape[-2] == 0:
    raise ValueError(f"{layer}: x holds no token (length 0); x must be {want}; got shape {shape}.")
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise ValueError(
        f"{layer}: x must be floating embeddings {want}; got {jnp.result_type(x)} (token ids go "
        "through an embedding first, e.g. flax.linen.Embed)."
    )
  return len(shape) == 2


def add_batch_axis(layer: str, x, mask, memory=None, memory_mask=None):
  """``x [N, D]``, ``mask [N]``, ``memory [M, D]``, ``memory_mask [M]`` (each may be None but
  x) with a leading batch axis of one; the masks are checked first (boolean, one entry per
  token)."""
  n = x.shape[0]
  mask = check_mask(mask, (n,), layout="[length]", against=f"{layer}'s x of shape {x.shape}")
  if memory is not None:
    m = jnp.shape(memory)[0]
    memory_mask = check_mask(
        memory_mask, (m,), name="memory_mask", layout="[M]", against=f"memory {memory.shape}"
    )
  one = lambda a: None if a is None else a[None]
  return one(x), one(mask), one(memory), one(memory_mask)


def attention_schemes(cfg: AttentionConfig) -> list[PositionalSpec]:
  """The schemes an attention layer calls (all but embedding-only ones)."""
  return [p for p in cfg.positional if set(p.cls.hooks) - {"embed"}]


def _materialise(log_table, n: int, grid):
  """``[h, 2N-1]`` / ``[h, 2H-1, 2W-1]`` offset table -> ``[h, N, N]`` bias b_{j-i}."""
  if grid is None:
    return toeplitz.dense_toeplitz(log_table)
  return toeplitz.dense_toeplitz_2d(log_table, grid)


def _decay_bias(log_decay, n: int, grid):
  """``[h, N, N]`` (i-j) log r for j <= i (0 above the diagonal; the causal mask hides it)."""
  del grid  # raster order: the distance is the raster index difference
  dist = jnp.maximum(jnp.arange(n)[:, None] - jnp.arange(n)[None, :], 0)
  return log_decay[:, None, None] * dist[None].astype(log_decay.dtype)


class Attention(nn.Module):
  """Multi-head attention: ``x [b, N, D] -> [b, N, D]`` (float; ``[N, D] -> [N, D]`` too).

  Called as ``layer(x, mask=None, grid=None, deterministic=True)`` (every argument after ``x``
  by keyword; the convention of ``Block``, ``Tower`` and the models): ``mask [b, N]`` bool,
  True for real tokens. Returns the array ``[b, N, D]`` in ``dtype``. ``x`` must be ``[b, N,
  D]`` with D = ``cfg.embed_dim`` and N >= 1, or one example ``[N, D]`` (with ``mask [N]``):
  a batch axis of one is added and removed, so the layer runs under a per-example
  ``jax.vmap``; anything else raises ValueError naming the expected and the given shape.

  Example::

      cfg = fastpos.attention_config(32, 4, kernel="elu1", positional="rope", causal=True)
      layer = fastpos.Attention(cfg)
      x = jnp.ones((2, 10, 32))                          # [batch, N, D] float32
      variables = layer.init(jax.random.key(0), x)
      y = layer.apply(variables, x, mask=jnp.ones((2, 10), bool))   # [2, 10, 32]
      one = layer.apply(variables, x[0])                 # [10, 32]: one example

  Attributes:
    cfg: the static layer description (kernel, schemes, sizes).
    shared: scheme modules built once by the model and shared by every layer (schemes with
      ``share_across_layers``); matched by scheme name.
    dtype: activation dtype of the projections.
  """

  cfg: AttentionConfig
  shared: tuple = ()
  dtype: Any = jnp.float32

  def __post_init__(self):
    check_layer_schemes(self.cfg, self.shared, "Attention")  # at construction, before any init
    super().__post_init__()

  def feature_projection(self, spec, dim: int, dtype, deterministic: bool):
    """The random-feature projection of this layer (None for kernels without one): redrawn
    from the ``features`` rng when training with ``redraw``, else fixed by the kernel's seed
    and the layer's path (so decoding steps use the projection the full forward used), the
    path it has in the unrolled model also under ``nn.scan`` (``positional.path_keys``)."""
    if not spec.needs_projection:
      return None
    if spec.redraw and not deterministic:
      key = self.make_rng("features")
    else:
      key = path_keys.fixed_key(self, spec.seed)
    return spec.make_projection(key, dim, dtype=dtype)

  def setup(self):
    # The layer's own scheme modules (those the model does not share), defined here rather
    # than in the compact call so that ``chunked_layer`` (called by a block instead of the
    # layer) reaches them too; parameters under ``pos_<name>`` either way.
    shared = {type(s).scheme_name for s in self.shared}
    dims = self.cfg.scheme_dims()
    # The config's plan checked every option: the classes are built without another check.
    self.own_schemes = tuple(
        spec.cls(dims=dims[spec.name], **spec.option_dict(), name=f"pos_{spec.name}")
        for spec in attention_schemes(self.cfg)
        if spec.name not in shared
    )

  @nn.compact
  def __call__(
      self,
      x,
      *,
      mask=None,
      grid=None,
      memory=None,
      deterministic: bool = True,
      reference: bool = False,
      decode=None,
  ):
    """Args:
    x: ``[batch, N, D]``.
    mask: ``[batch, N]`` bool, True for real tokens (``[batch, M+N]`` with memory). Boolean
      only: any other dtype or shape raises ValueError (``fastpos.ops.masks``).
    grid: (H, W) with H * W == N for 2D inputs; required iff the layer was built 2D.
    memory: ``[batch, M, D]`` earlier states (Transformer-XL): keys and values are computed
      over ``[memory, x]``; softmax kernel only.
    deterministic: no feature redraw.
    reference: dense O(N^2) references instead of the fast paths.
    decode: a ``fastpos.models.decoding.Step``: x holds new tokens, attended against the
      layer's ``cache`` collection (``fastpos.models.decoding``).

    Returns:
      ``[batch, N, D]`` in ``dtype`` (``[N, D]`` for an unbatched ``x``).
    """
    if check_input("Attention", x, self.cfg.embed_dim):  # one example: a batch axis of one
      x, mask, memory, _ = add_batch_axis("Attention", x, mask, memory)
      return self._attend(x, mask, grid, memory, deterministic, reference, decode)[0]
    return self._attend(x, mask, grid, memory, deterministic, reference, decode)

  def _attend(self, x, mask, grid, memory, deterministic, reference, decode):
    """The layer on a batched ``x`` (called from the compact ``__call__``: it creates the
    projections)."""
    grid, mask = self._check_inputs(x, mask, grid, memory)
    chunking = self.by_chunks(x, memory, decode, reference)
    plan = self._plan(chunking, memory, decode, reference)
    if chunking:
      return chunked.attend(x, mask, self._chunk_parts(plan, x, mask, deterministic))
    dense = lambda name: nn.DenseGeneral(
        (self.cfg.num_heads, self.cfg.head_dim), dtype=self.dtype, name=name
    )
    q = dense("query")(x)
    kv_in = x if memory is None else jnp.concatenate([memory.astype(x.dtype), x], axis=1)
    k = dense("key")(kv_in)
    v = dense("value")(kv_in)
    if mask is not None:
      # Padded keys and values contribute nothing anywhere (also to output terms like W V).
      v = jnp.where(mask[:, :, None, None], v, jnp.zeros((), v.dtype))

    hooks = hooks_lib.Hooks.of(self._schemes())
    settings = dict(deterministic=deterministic, reference=reference)
    if decode is None:
      path = FullPath(plan, self.cfg, hooks, v, mask, grid=grid, length=x.shape[1], **settings)
    else:
      path = decoding.StepPath(self, hooks, v, mask, decode, **settings)
    draw = functools.partial(
        self.feature_projection, self.cfg.kernel, deterministic=deterministic or decode is not None
    )
    out = hooks_lib.run(hooks, path, q, k, kernel=self.cfg.kernel, projection=draw)
    out = out.astype(self.dtype)
    return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), dtype=self.dtype, name="out")(out)

  def _plan(self, chunking: bool, memory, decode, reference: bool):
    """The config's plan for this call (raises ValueError for a setting it does not build)."""
    return self.cfg.plan(
        compatibility.Setting(
            attn_chunk=self.cfg.attn_chunk if chunking else 0,
            seq=1 if reference or decode is not None else cp.seq_size(),
            packed=segments.active() is not None,
            memory=memory is not None,
            decoding=decode is not None,
        )
    )

  def by_chunks(self, x, memory, decode, reference) -> bool:
    """Whether this call runs by chunks (``cfg.attn_chunk``): not while initialising (the
    parameters are built by the whole-sequence path), decoding, with memory or as the dense
    reference, and only with more than one chunk in a device's block of the sequence."""
    chunk = self.cfg.attn_chunk
    if not chunk or decode is not None or memory is not None or reference:
      return False
    return not self.is_initializing() and -(-x.shape[1] // cp.seq_size()) > chunk

  def chunked_layer(
      self, x, *, mask=None, grid=None, deterministic: bool = True
  ) -> chunked.LayerParts:
    """This layer as ``fastpos.models.chunked_attention.attend`` runs it on ``x [b, N, D]``
    (``mask [b, N]`` bool or None; ``grid`` as the call takes it), for a call that runs by
    chunks (``by_chunks``), the inputs checked and the setting planned as the call does. The
    call itself returns ``attend(x, mask, chunked_layer(x, mask=mask))``; a block that runs
    what follows the layer inside the same chunk loop passes its own ``tail`` to ``attend``.

    Raises:
      ValueError: for inputs the call refuses, or a call that does not run by chunks.
    """
    _, mask = self._check_inputs(x, mask, grid, None)
    if not self.by_chunks(x, None, None, False):
      raise ValueError(
          f"Attention.chunked_layer: a call on x of shape {x.shape} does not run by chunks "
          f"(attn_chunk={self.cfg.attn_chunk}; see Attention.by_chunks)."
      )
    return self._chunk_parts(self._plan(True, None, None, False), x, mask, deterministic)

  def _chunk_parts(self, plan, x, mask, deterministic) -> chunked.LayerParts:
    """The layer by chunks of the sequence (``fastpos.models.chunked_attention.attend``):
    the same parameters, projection draw and output hooks as the whole-sequence path."""
    hooks = hooks_lib.Hooks.of(self._schemes())
    kernel = self.cfg.kernel
    state = jnp.promote_types(self.dtype, jnp.float32)  # as the hooks' linear path draws it
    w = self.feature_projection(kernel, self.cfg.head_dim, state, deterministic)

    def terms(v):
      path = FullPath(
          plan,
          self.cfg,
          hooks,
          v,
          mask,
          grid=None,
          length=x.shape[1],
          deterministic=deterministic,
          reference=False,
      )
      return hooks_lib.output_terms(hooks, path)

    return chunked.LayerParts(
        cfg=self.cfg,
        params=self.variables["params"],
        dtype=self.dtype,
        terms=terms if hooks.output else None,
        projection=w,
        parts=cp.seq_size(),
    )

  def _check_inputs(self, x, mask, grid, memory):
    """Raises ValueError for a grid, memory or mask that does not fit the layer (what runs
    with memory or packing is the plan's: ``AttentionConfig.plan``); returns ``(grid, mask)``
    normalised (grid a tuple of ints, mask checked)."""
    cfg = self.cfg
    b, n, _ = x.shape
    if (grid is None) != (cfg.grid is None):
      raise ValueError(f"the layer was built with grid={cfg.grid} but called with grid={grid}.")
    if grid is not None:
      grid = tuple(int(g) for g in grid)
      if grid[0] * grid[1] != n:
        raise ValueError(f"grid {grid} does not cover the sequence length {n}.")
    if memory is None:
      return grid, check_mask(mask, (b, n), against=f"x of shape {x.shape}")
    mask = check_mask(
        mask,
        (b, memory.shape[1] + n),
        layout="[batch, M+N]",
        against=f"memory {memory.shape} and x {x.shape}",
    )
    return grid, mask

  def _schemes(self) -> list:
    """The scheme modules this layer calls, in the config's order: the shared ones (matched by
    scheme name), else its own (``setup``)."""
    own = iter(self.own_schemes)
    shared = {type(s).scheme_name: s for s in self.shared}
    return [
        shared[spec.name] if spec.name in shared else next(own)
        for spec in attention_schemes(self.cfg)
    ]


class FullPath:
  """The full forward's ``fastpos.models.hooks.Path``: keys and values are the sequence's
  (after ``memory``), ``kv`` tables are materialised (softmax) or FFT weights (linear), and the
  ops are ``fastpos.ops.attention``'s (their dense references with ``reference``, the
  context-parallel forms when the sequence is split over devices)."""

  def __init__(self, plan, cfg, hooks, v, mask, *, grid, length, deterministic, reference):
    self.cfg, self.v, self.mask, self.grid, self.n = cfg, v, mask, grid, length
    self.reference = reference
    self.split = plan.split  # the sequence is split over devices
    # The causal scan keeps a running maximum of the keys' scale (``Plan.key_scales``).
    self.scaled = plan.key_scales and not reference
    memory_length = v.shape[1] - length
    self.ctx = positional.Context(
        mask=mask,
        grid=grid,
        causal=cfg.causal,
        reference=reference,
        deterministic=deterministic,
        length=length,
        memory_length=memory_length,
    )
    self.mix = hooks.mix(self.ctx)
    self.post_phi = hooks.post_phi
    self.values = v[:, memory_length:]
    self.output_term = cp.output if self.split else None

  def keys(self, k):
    return k

  def bias_terms(self, q) -> list:
    """The ``kv`` table as b_{j-i}, the decay as (i-j) log r, the packed segments' bias."""
    terms = []
    if self.mix.log_table is not None:
      terms.append(_materialise(self.mix.log_table, self.n, self.grid)[None])
    if self.mix.log_decay is not None:
      terms.append(_decay_bias(self.mix.log_decay, self.n, self.grid)[None])
    segs = segments.active()
    if segs is not None:
      terms.append(segments.segment_bias(segs.ids, q.dtype))
    return terms

  def softmax(self, q, keys, bias):
    fn = attn_ops.softmax_attention_reference if self.reference else attn_ops.softmax_attention
    d = self.cfg.head_dim
    return fn(q, keys, self.v, bias=bias, mask=self.mask, causal=self.cfg.causal, scale=d**-0.5)

  def key_features(self, k, projection) -> hooks_lib.KeyFeatures:
    kernel = self.cfg.kernel
    segs = segments.active()
    if segs is not None and kernel.name in segments.STABILISED_KEYS:
      # Packed: each segment's keys take the stabiliser they have alone.
      parts = functools.partial(segments.segment_key_parts, kernel.name, k, segs.ids)
      if self.scaled:
        e, log_scale, key_eps = parts(projection=projection, mask=self.mask, causal=True)
        return hooks_lib.KeyFeatures((e,), log_scale=log_scale, eps=key_eps)
      fk = segments.segment_key_features(
          kernel.name, k, segs.ids, projection=projection, mask=self.mask, causal=self.cfg.causal
      )
      return hooks_lib.KeyFeatures((fk,))
    if self.scaled:
      e, log_scale, key_eps = feature_ops.causal_key_parts(
          kernel, k, projection=projection, mask=self.mask, nu=kernel.nu
      )
      return hooks_lib.KeyFeatures((e,), log_scale=log_scale, eps=key_eps)
    fk = kernel.phi(
        k, projection=projection, is_query=False, mask=self.mask, causal=self.cfg.causal
    )
    return hooks_lib.KeyFeatures((fk,))

  def linear(self, num, den, keys, dtype):
    cfg = self.cfg
    (fq, (fk,)), mix = num, self.mix
    segs = segments.active()
    packed = {} if segs is None else {"segment_ids": segs.ids}  # no state crosses a segment
    if keys.log_scale is not None:
      # The causal scan keeps a running maximum of the keys' scale s (``scaled_keys``), so a
      # late key far above the first cannot overflow.
      return attn_ops.linear_attention(
          fq,
          fk,
          self.v,
          mask=self.mask,
          causal=True,
          eps=cfg.kernel.eps,
          chunk_size=cfg.chunk_size,
          key_log_scale=keys.log_scale,
          key_eps=keys.eps,
          mode=cfg.mode,
          **packed,
      )
    rpe = None if mix.log_table is None else jnp.exp(mix.log_table.astype(dtype))
    kw = dict(
        mask=self.mask,
        causal=cfg.causal,
        rpe=rpe,
        grid=self.grid if rpe is not None else None,
        decay=None if mix.log_decay is None else mix.log_decay.astype(dtype),
        den_features=None if den is None else (den[0], den[1][0]),
        eps=cfg.kernel.eps,
    )
    if self.reference:
      return attn_ops.linear_attention_reference(fq, fk, self.v, **kw, **packed)
    if self.split:  # the sequence split over devices has its own causal path
      return cp.linear_attention(fq, fk, self.v, chunk_size=cfg.chunk_size, **kw, **packed)
    return attn_ops.linear_attention(
        fq, fk, self.v, chunk_size=cfg.chunk_size, mode=cfg.mode, **kw, **packed
    )
