"""fastpos: efficient attention with relative positional encodings in JAX/Flax.

The public API is ``__all__``: everything a researcher imports is named here, and everything
else may change without notice. Names load on first use (PEP 562), so ``import fastpos``
imports neither jax, flax nor numpy (``fastpos.config_schema``, read by the config files,
stays light).

Example::

    import jax, jax.numpy as jnp
    import fastpos

    layer = fastpos.attention(embed_dim=64, num_heads=4, kernel="elu1",
                              positional=("rope", "fastrpb"), causal=True, max_length=128,
                              fastrpb={"per_head": True})
    x = jnp.ones((2, 16, 64))                          # [batch, N, embed_dim]
    params = layer.init(jax.random.key(0), x)
    y = layer.apply(params, x)                         # [batch, N, embed_dim]

    model, params, config, task = fastpos.load("/tmp/run")   # a workdir train.py wrote
    tokens = fastpos.generate(model, params, jnp.array([[5, 9]]), num_tokens=20)
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public name -> the module that defines it (imported on first access).
_PUBLIC = {
    # The attention layer and its records.
    "attention": "fastpos.layers",
    "attention_config": "fastpos.layers",
    "Attention": "fastpos.models.attention",
    "AttentionConfig": "fastpos.models.attention",
    "KernelSpec": "fastpos.models.attention",
    "PositionalSpec": "fastpos.models.attention",
    # Models and their building blocks.
    "Block": "fastpos.models.blocks",
    "Tower": "fastpos.models.transformer",
    "Classifier": "fastpos.models.transformer",
    "DualEncoder": "fastpos.models.transformer",
    "DecoderLM": "fastpos.models.transformer",
    "build_model": "fastpos.models",
    # Schemes and kernels: names, options, extension.
    "SCHEMES": "fastpos.positional",
    "KERNELS": "fastpos.ops.features",
    "Scheme": "fastpos.positional.base",
    "Option": "fastpos.positional.base",
    "register_scheme": "fastpos.extend",
    "scheme_options": "fastpos.extend",
    # Trained runs, sampling and decoding.
    "load": "fastpos.loading",
    "Loaded": "fastpos.loading",
    "generate": "fastpos.generation",
    "CachedDecoding": "fastpos.stack_decoding",
    # Training (the library functions behind train.py / eval.py).
    "train_and_evaluate": "fastpos.train",
    "evaluate": "fastpos.train",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
  module = _PUBLIC.get(name)
  if module is None:
    raise AttributeError(f"module 'fastpos' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value  # later lookups skip this function
  return value


def __dir__():
  return sorted(set(globals()) | set(_PUBLIC))
