"""Trainer tests compile the same tiny train / eval steps in several runs: a persistent
compilation cache (a temporary folder, for this package only) compiles each once.

In a random order the package's tests come in several stretches, between which the fixture is
torn down; the folder is the same for all of them (one per test process), so each stretch
finds what the earlier ones compiled."""

from __future__ import annotations

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache


@pytest.fixture(scope="package", autouse=True)
def _compilation_cache(tmp_path_factory):
  keys = (
      "jax_compilation_cache_dir",
      "jax_persistent_cache_min_compile_time_secs",
      "jax_persistent_cache_min_entry_size_bytes",
  )
  previous = {k: getattr(jax.config, k) for k in keys}
  compilation_cache.reset_cache()
  cache = tmp_path_factory.getbasetemp() / "train_jax_cache"
  cache.mkdir(exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(cache))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  yield
  compilation_cache.reset_cache()
  for k, v in previous.items():
    jax.config.update(k, v)
