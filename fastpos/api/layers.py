"""The attention layer from flat keywords: ``attention(...)`` and ``attention_config(...)``.

Both read like ``fla.layers.LinearAttention(hidden_size, num_heads, feature_map=...)``: the
kernel, the positional schemes, their options and the sizes are keywords, checked before any
parameter exists (an unknown name, an option the kernel or scheme does not take, a value out
of range or an incompatible kernel x scheme pair raises ValueError naming the valid choices).
They build the records the models use (``AttentionConfig``, ``KernelSpec``,
``PositionalSpec.make``; the models build theirs from a model config with
``AttentionConfig.from_model_config``), so a layer made here has the parameters the models'
layers have.

The keyword values go through the config's own declarations (``fastpos.config_schema``: the
field ``model.<keyword>``, or the kernel option ``fastpos.ops.features.OPTIONS[<keyword>]``),
so ``eps=nan`` fails here as ``--config.model.kernel_options.eps=nan`` fails train.py; the
message names the keyword the caller passed. A keyword that is neither a parameter nor a
positional scheme's name (a typo such as ``kernal=``) raises TypeError with the closest
keyword and the valid ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import Any, Mapping, Sequence

import jax.numpy as jnp

from fastpos import config_schema, positional
from fastpos.models.attention import Attention, AttentionConfig, KernelSpec, PositionalSpec
from fastpos.ops import features

DEFAULT_MAX_LENGTH = 512

_FIELDS = config_schema.FIELDS
# Each keyword's declaration: the config field it stands for (a layer has no task to take its
# max_length from, so 0 is not a choice there; causal comes from a config's task).
KEYWORD_FIELDS: dict[str, config_schema.Field] = {
    "embed_dim": _FIELDS["model.embed_dim"],
    "num_heads": _FIELDS["model.num_heads"],
    "head_dim": _FIELDS["model.head_dim"],  # None or 0: embed_dim // num_heads
    "kernel": config_schema.field("model.kernel"),  # the choices: features.KERNELS
    "causal": config_schema.Field("bool", default=False),
    "max_length": dataclasses.replace(_FIELDS["model.max_length"], low=1),
    "chunk_size": _FIELDS["model.chunk_size"],  # None or 0: chosen by shape
    "mode": _FIELDS["model.attention_mode"],
    **features.OPTIONS,
}


def check_keywords(caller: str, values: Mapping[str, Any]) -> None:
  """Raises ValueError, ``"<caller>: <keyword> must be <valid values>; got <value>."``, for the
  first keyword of ``values`` (None: its default) outside its declaration (``KEYWORD_FIELDS``,
  the config schema's fields)."""
  for name, value in values.items():
    decl = KEYWORD_FIELDS.get(name)
    if decl is not None and value is not None and not decl.is_valid(value):
      raise ValueError(f"{caller}: {name} must be {decl.describe()}; got {value!r}.")


def check_unknown(caller: str, keywords: Mapping[str, Any], valid: Sequence[str]) -> None:
  """Raises TypeError for a keyword that is neither one of ``valid`` nor a positional scheme's
  name (a scheme's options go as ``<scheme>={...}``), suggesting the closest (difflib)."""
  for key in keywords:
    if key in valid or key in positional.SCHEMES:
      continue
    close = difflib.get_close_matches(key, [*valid, *positional.SCHEMES], n=1)
    hint = f" Did you mean {close[0]}=?" if close else ""
    raise TypeError(
        f"{caller}: unknown keyword {key}={keywords[key]!r}.{hint} Valid keywords: "
        f"{', '.join(valid)}, and <scheme>={{option: value}} for a scheme of positional= "
        f"({', '.join(positional.SCHEMES)})."
    )


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
  return _config("fastpos.attention_config", **{k: v for k, v in locals().items()})


def _config(caller: str, **kw: Any) -> AttentionConfig:
  """``attention_config`` for ``caller`` (whose name its errors give)."""
  scheme_options = kw.pop("scheme_options")
  check_unknown(caller, scheme_options, _KEYWORDS)
  check_keywords(caller, kw)
  embed_dim, num_heads, head_dim = kw["embed_dim"], kw["num_heads"], kw["head_dim"] or None
  names = _scheme_names(kw["positional"])
  merged = dict(kw["options"] or {})
  for key in set(merged) & set(scheme_options):
    raise ValueError(f"options for {key!r} given twice: in options= and as {key}=.")
  merged.update(scheme_options)
  kopts = {k: kw[k] for k in features.OPTIONS}
  spec = _kernel_spec(kw["kernel"], {k: v for k, v in kopts.items() if v is not None})
  if head_dim is None:
    if embed_dim % num_heads:
      raise ValueError(
          f"{caller}: embed_dim={embed_dim} is not divisible by num_heads={num_heads}; give "
          "head_dim."
      )
    head_dim = embed_dim // num_heads
  grid = kw["grid"]
  return AttentionConfig(
      num_heads=num_heads,
      head_dim=head_dim,
      embed_dim=embed_dim,
      kernel=spec,
      positional=_scheme_specs(names, merged),
      max_length=kw["max_length"],
      grid=None if grid is None else tuple(grid),
      causal=kw["causal"],
      chunk_size=kw["chunk_size"] or None,
      mode=kw["mode"],
  )


_KEYWORDS = tuple(
    p for p in inspect.signature(attention_config).parameters if p != "scheme_options"
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
  check_unknown("fastpos.attention", keywords, (*_KEYWORDS, "dtype", "name"))
  params = inspect.signature(attention_config).parameters
  values = {k: p.default for k, p in params.items() if k not in ("embed_dim", "num_heads")}
  values.update(scheme_options={k: keywords.pop(k) for k in list(keywords) if k not in params})
  values.update(keywords)
  cfg = _config("fastpos.attention", embed_dim=embed_dim, num_heads=num_heads, **values)
  return Attention(cfg, dtype=dtype, name=name)


__all__ = ["attention", "attention_config"]
