"""The check of a whole config before anything is built, and the base config it checks.

``base_config(task)`` is ``fastpos.config_schema.base_config``: the complete config of a run on
``task`` (task block included), built from the owners' declarations that also give each field's
valid values (docs/config.md); the experiment files (``configs/*.py``) build on it. The config alone
defines a run; only ``--workdir`` is outside it.

``validate`` checks every value against its declaration (``fastpos.config_schema``, and each
positional scheme's ``option_spec``) and the rules between a task's fields. It runs once on the
way in: the command line's ``fastpos.train.cli.config_of`` validates, and the library's entries
(``build_run``, ``fastpos.load``) take their config through ``checked``, which validates only a
config that has not been validated as it stands (a library caller's own, or one changed since).
"""

from __future__ import annotations

import ml_collections

from fastpos import config_schema
from fastpos.config_schema import base_config
from fastpos.tasks import task_info
from fastpos.train.errors import RunError

__all__ = ["InvalidConfigError", "base_config", "checked", "validate"]

# The attribute ``validate`` leaves on a config it passed: the config's content then (JSON).
_VALIDATED = "_fastpos_validated"


class InvalidConfigError(RunError, ValueError):
  """A config value outside its declaration (exit code 2; a ValueError for library callers)."""


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Checks ``cfg`` before anything is built: every field (the task block complete) against its
  declared type and range (``fastpos.config_schema``), the positional scheme names and each
  scheme's options against its ``option_spec``, and the rules between a task's fields.

  Raises:
    InvalidConfigError: one line naming the field, its value and the valid values (exit code 2).
  """
  try:
    config_schema.check(cfg)
  except config_schema.ConfigValueError as e:
    raise InvalidConfigError(str(e)) from None
  _check_positional(cfg.model)
  try:
    task_info(cfg.task)  # the rules between the task's fields (no data read)
  except (ValueError, TypeError) as e:
    raise InvalidConfigError(f"config.task: {e}") from None
  object.__setattr__(cfg, _VALIDATED, _content(cfg))  # not a field: outside the config


def checked(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of ``cfg`` with its references resolved, validated (``validate``) unless ``cfg``
  passed ``validate`` with the content it holds now.

  Raises:
    InvalidConfigError: as ``validate``.
  """
  out = cfg.copy_and_resolve_references()
  if getattr(cfg, _VALIDATED, None) != _content(out):
    validate(out)
  return out


def _content(cfg: ml_collections.ConfigDict) -> str:
  return cfg.to_json_best_effort(sort_keys=True)


def _check_positional(model: ml_collections.ConfigDict) -> None:
  from fastpos import positional  # pylint: disable=import-outside-toplevel (flax)

  try:
    positional.parse_names(model.positional)
  except ValueError as e:
    raise InvalidConfigError(f"config.model.positional={model.positional!r}: {e}") from None
  for scheme, options in model.positional_options.items():
    where = f"config.model.positional_options.{scheme}"
    if scheme not in positional.SCHEMES:
      raise InvalidConfigError(
          f"{where}: unknown positional scheme {scheme!r}; valid schemes: "
          f"{', '.join(positional.SCHEMES)}."
      )
    if not hasattr(options, "keys"):
      raise InvalidConfigError(f"{where} must be a block of options; got {options!r}.")
    spec = positional.get_class(scheme).option_spec
    for name, value in options.items():
      if name not in spec:
        raise InvalidConfigError(
            f"{where} has no option {name!r}; its options: " f"{', '.join(spec) or '(none)'}."
        )
      value = tuple(value) if isinstance(value, list) else value
      if not spec[name].is_valid(value):
        note = f" ({spec[name].note})" if spec[name].note else ""
        raise InvalidConfigError(
            f"{where}.{name} must be {spec[name].describe()}{note}; got " f"{value!r}."
        )
    try:
      positional.get_class(scheme).resolve_options(dict(options))
    except ValueError as e:
      raise InvalidConfigError(f"{where}: {e}") from None
