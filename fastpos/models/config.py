"""The model's part of a config: ``model_config()``, the base of every experiment's
``config.model``, declared with the rest of the config in ``fastpos.config_schema`` (each field
with its default, its comment and its valid values)."""

from __future__ import annotations

from fastpos.config_schema import model_config

__all__ = ["model_config"]
