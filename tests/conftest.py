"""Test-wide JAX settings: float64 available, implicit rank promotion is an error."""

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
