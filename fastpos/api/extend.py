"""Extending fastpos from outside the package: ``register_scheme`` and ``scheme_options``.

A positional scheme is a ``fastpos.Scheme`` subclass (a Flax module; the contract is
``fastpos.positional.base``): its ``scheme_name``, the ``hooks`` it acts at, what it supports
(``supports_causal``, ``supports_1d``, ``supports_2d``), its options (``option_spec``) and
the methods of its hooks. Registered, it is a name like the built-in ones: the layer, the
models, configs (``model.positional``), the compatibility table and the options table see it.
"""

from __future__ import annotations

from fastpos import positional
from fastpos.ops import features
from fastpos.positional.base import FEATURE_STAGES, HOOKS, Option, Scheme


def register_scheme(cls: type[Scheme], *, replace: bool = False) -> type[Scheme]:
  """Registers a positional scheme class under its ``scheme_name``; returns the class (so it
  can decorate it).

  Raises ValueError (before anything is registered) for a class that is not a ``Scheme``,
  an empty or taken name (unless ``replace``), or hooks / feature stage / options outside the
  contract.

  Example::

      @fastpos.register_scheme
      class Alibi(fastpos.Scheme):
        scheme_name = "alibi"
        hooks = ("logits",)                 # adds [1, h, Lq, Lk] to the scaled logits
        option_spec = {"max_slope": fastpos.Option(0.5, "slope of head 0", type="number",
                                                   low=0, low_open=True)}
        def logits(self, q, k, ctx): ...

      layer = fastpos.attention(64, 4, positional="alibi", causal=True)
  """
  if not (isinstance(cls, type) and issubclass(cls, Scheme)):
    raise ValueError(f"register_scheme takes a subclass of fastpos.Scheme; got {cls!r}.")
  name = cls.scheme_name
  if not isinstance(name, str) or not name or not name.isidentifier():
    raise ValueError(
        f"{cls.__name__}.scheme_name must be a non-empty identifier (it is a config name and "
        f"a keyword of fastpos.attention); got {name!r}."
    )
  if name in positional.SCHEMES and positional.SCHEMES[name] is not cls and not replace:
    raise ValueError(
        f"positional scheme {name!r} is already registered "
        f"({positional.SCHEMES[name].__module__}.{positional.SCHEMES[name].__name__}); pick "
        f"another scheme_name or pass replace=True."
    )
  bad = [h for h in cls.hooks if h not in HOOKS]
  if bad or not isinstance(cls.hooks, tuple):
    raise ValueError(
        f"{cls.__name__}.hooks must be a tuple of {', '.join(HOOKS)}; got {cls.hooks!r}."
    )
  if cls.feature_stage not in FEATURE_STAGES:
    raise ValueError(
        f"{cls.__name__}.feature_stage must be one of {', '.join(FEATURE_STAGES)}; got "
        f"{cls.feature_stage!r}."
    )
  for opt, spec in cls.option_spec.items():
    if not isinstance(spec, Option):
      raise ValueError(f"{cls.__name__}.option_spec[{opt!r}] must be a fastpos.Option.")
  cls.resolve_options({})  # the defaults must be valid
  for hook in cls.hooks:
    if getattr(cls, hook) is getattr(Scheme, hook):
      raise ValueError(f"{cls.__name__} lists the {hook!r} hook but does not implement {hook}().")
  positional.SCHEMES[name] = cls
  return cls


def scheme_options(name: str) -> dict[str, Option]:
  """The options of positional scheme ``name``: ``{option: Option}`` (type, default, valid
  values, meaning: ``Option.describe()``, ``Option.doc``).

  Example::

      >>> fastpos.scheme_options("fastrpb")["per_head"].default
      False
  """
  return dict(positional.get_class(name).option_spec)


def scheme_names() -> tuple[str, ...]:
  """The positional schemes, built-in and registered (``positional=`` of ``fastpos.attention``).

  Example::

      >>> fastpos.scheme_names()[:3]
      ('none', 'absolute', 'fastrpb')
  """
  return tuple(positional.SCHEMES)


def kernel_names() -> tuple[str, ...]:
  """The attention kernels: ``"softmax"`` and the feature maps (``kernel=`` of
  ``fastpos.attention``).

  Example::

      >>> fastpos.kernel_names()[:3]
      ('softmax', 'elu1', 'relu')
  """
  return tuple(features.KERNELS)


__all__ = ["kernel_names", "register_scheme", "scheme_names", "scheme_options"]
