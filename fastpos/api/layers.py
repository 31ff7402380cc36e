"""The attention layer from flat keywords: ``attention(...)`` and ``attention_config(...)``.

Both read like ``fla.layers.LinearAttention(hidden_size, num_heads, feature_map=...)``: the
kernel, the positional schemes, their options and the sizes are keywords, checked before any
parameter exists (an unknown name, an option the kernel or scheme does not take, a value out
of range or an incompatible kernel x scheme pair raises ValueError naming the valid choices).
They build the records the models use (``AttentionConfig``, ``KernelSpec``,
``PositionalSpec.make``), so a layer made here has the parameters the models' layers have.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax.numpy as jnp

from fastpos import positional
from fastpos.models.attention import Attention, AttentionConfig, KernelSpec, PositionalSpec
from fastpos.ops import features

DEFAULT_MAX_LENGTH = 512


def _scheme_names(positional_: str | Sequence[str] | None) -> tuple[str, ...]:
  if positional_ is None:
    return ()
  if isinstance(positional_, str) or all(isinstance(p, str) for p in positional_):
    return positional.parse_names(positional_)
  raise ValueError(
      f"positional must be a scheme name, names joined by ',' or a sequence of names; got "
      f"{positional_!r}. Valid schemes: {', '.join(positional.SCHEMES)}."
  )


def _kernel_spec(kernel: str, options: Mapping[str, Any]) -> KernelSpec:
  """The kernel with only the options it reads: one it ignores is an error, not a no-op."""
  entry = features.get_kernel(kernel)  # unknown names stop here, naming the valid ones
  for key in options:
    if key not in entry.options:
      own = ", ".join(f"{k}={v!r}" for k, v in entry.defaults.items()) or "no options"
      raise ValueError(f"kernel {kernel!r} takes no option {key!r}; it takes: {own}.")
  return KernelSpec.from_config(kernel, dict(options))


def _scheme_specs(names, options: Mapping[str, Any]) -> tuple[PositionalSpec, ...]:
  for key, value in options.items():
    if key not in names:
      raise ValueError(
          f"options given for positional scheme {key!r}, which is not in positional="
          f"{names!r}; add it there or drop {key}=..."
      )
    if not isinstance(value, Mapping):
      raise ValueError(
          f"{key}= must be a dict of {key!r}'s options (e.g. {key}={{...}}); got {value!r}. "
          f"Its options: {', '.join(positional.option_names(key)) or '(none)'}."
      )
  return tuple(PositionalSpec.make(n, options.get(n)) for n in names)


def attention_config(
    embed_dim: int,
    num_heads: int,
    *,
    kernel: str = "softmax",
    positional: str | Sequence[str] | None = (),
    causal: bool = False,
    max_length: int = DEFAULT_MAX_LENGTH,
    head_dim: int | None = None,
    grid: tuple[int, int] | None = None,
    chunk_size: int | None = None,
    mode: str = "auto",
    options: Mapping[str, Mapping[str, Any]] | None = None,
    num_features: int | None = None,
    nu: int | None = None,
    eps: float | None = None,
    redraw: bool | None = None,
    seed: int | None = None,
    **scheme_options: Mapping[str, Any],
) -> AttentionConfig:
  """The ``AttentionConfig`` of a layer described by flat keywords (what models take).

  Args:
    embed_dim: D, the width of the layer's input and output ``[batch, N, D]``.
    num_heads: h.
    kernel: ``"softmax"`` or a feature map of ``fastpos.kernel_names()`` (``"elu1"``, ``"relu"``,
      ``"sikf"``, ``"dpfp"``, ``"favor"``, ``"prf"``, ``"trf"``, ``"nprf"``, ``"orf"``).
    positional: scheme names of ``fastpos.scheme_names()`` (a sequence, or joined by ``","``).
    causal: query i sees keys j <= i only (a decoder).
    max_length: the longest sequence the positional tables serve.
    head_dim: d per head; default ``embed_dim // num_heads``.
    grid: ``(H, W)`` for 2D inputs (images in raster order, N = H * W); None for 1D.
    chunk_size: causal linear attention's chunk; None picks it from the shape.
    mode: causal linear attention's algorithm (``fastpos.ops.linear_attn``): ``"chunk"``
      (chunkwise-parallel: no serial loop, every chunk's state held at once), ``"recurrent"``
      (a serial scan over chunks: one carried state), ``"fused"`` (one kernel, where built) or
      ``"auto"`` (the backend's measured choice). The same function to rounding; another
      value raises ValueError naming these.
    options: ``{scheme: {option: value}}``, the same as the scheme keywords below.
    num_features, nu, eps, redraw, seed: the kernel's options (None: its default); one the
      kernel does not read raises (``python -m fastpos.positional.compatibility --options``
      lists every kernel's and scheme's options).
    **scheme_options: ``<scheme>={option: value}``, e.g. ``fastrpb={"per_head": True}``.

  Returns:
    A frozen, hashable ``AttentionConfig`` (a Flax module field).

  Example::

      cfg = fastpos.attention_config(256, 4, kernel="sikf", positional="fastrpb",
                                     causal=True, max_length=1024,
                                     fastrpb={"per_head": True})
      model = fastpos.DecoderLM(cfg, vocab_size=1000, num_layers=2, mlp_dim=512)
  """
  names = _scheme_names(positional)
  merged = dict(options or {})
  for key in set(merged) & set(scheme_options):
    raise ValueError(f"options for {key!r} given twice: in options= and as {key}=.")
  merged.update(scheme_options)
  kopts = dict(num_features=num_features, nu=nu, eps=eps, redraw=redraw, seed=seed)
  spec = _kernel_spec(kernel, {k: v for k, v in kopts.items() if v is not None})
  if head_dim is None:
    if not isinstance(embed_dim, int) or not isinstance(num_heads, int) or num_heads < 1:
      raise ValueError(
          f"embed_dim and num_heads must be ints >= 1; got {embed_dim!r}, {num_heads!r}."
      )
    if embed_dim % num_heads:
      raise ValueError(
          f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}; give head_dim."
      )
    head_dim = embed_dim // num_heads
  return AttentionConfig(
      num_heads=num_heads,
      head_dim=head_dim,
      embed_dim=embed_dim,
      kernel=spec,
      positional=_scheme_specs(names, merged),
      max_length=max_length,
      grid=None if grid is None else tuple(grid),
      causal=causal,
      chunk_size=chunk_size,
      mode=mode,
  )


def attention(
    embed_dim: int,
    num_heads: int,
    *,
    dtype: Any = jnp.float32,
    name: str | None = None,
    **keywords: Any,
) -> Attention:
  """A multi-head attention layer ``x [batch, N, D] -> [batch, N, D]`` (a Flax linen module).

  Keywords as ``attention_config`` (kernel, positional, causal, max_length, scheme and kernel
  options); ``dtype`` is the projections' activation dtype. Call it as
  ``layer(x, mask=None, grid=None, deterministic=True)``: ``mask [batch, N]`` bool, True for
  real tokens (padded keys contribute nothing); ``grid`` (H, W) iff built 2D. Schemes at the
  embed hook (``absolute``) belong to the model's embeddings, not to a layer: use a ``Tower``
  or model, or apply them yourself.

  Example::

      layer = fastpos.attention(64, 4, kernel="elu1", positional=("rope", "fastrpb"),
                                causal=True, max_length=128, fastrpb={"per_head": True})
      x = jnp.ones((2, 16, 64))                      # [batch, N, D]
      variables = layer.init(jax.random.key(0), x)
      y = layer.apply(variables, x)                  # [2, 16, 64]
  """
  cfg = attention_config(embed_dim, num_heads, **keywords)
  return Attention(cfg, dtype=dtype, name=name)


__all__ = ["attention", "attention_config"]
