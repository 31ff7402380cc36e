"""fastpos: efficient attention with relative positional encodings in JAX/Flax.

The public API is ``__all__``: everything a researcher imports is named here, and everything
else may change without notice. Names load on first use (PEP 562), so ``import fastpos``
imports neither jax, flax nor numpy (nor does ``fastpos.config_schema``, read by the config
files). Shapes: ``[batch, N, D]`` activations, ``[batch, N]`` token ids and boolean
masks (True for real tokens).

Example::

    import jax, jax.numpy as jnp
    import fastpos

    layer = fastpos.attention(64, 4, kernel="elu1", positional=("rope", "fastrpb"),
                              causal=True, max_length=128, fastrpb={"per_head": True})
    x = jnp.ones((2, 16, 64))                          # [batch, N, embed_dim]
    variables = layer.init(jax.random.key(0), x)
    y = layer.apply(variables, x)                      # [batch, N, embed_dim]

    model, params, config, task = fastpos.load(workdir)   # a train.py --workdir
    tokens = fastpos.generate(model, params, jnp.array([[5, 9]]), num_tokens=20)  # [1, 20]

The examples of this package's docstrings assume ``import jax, jax.numpy as jnp, flax.linen as
nn, fastpos`` and, where they read a trained run, ``workdir`` (a ``train.py --workdir``); the
tests run every one of them (tests/test_api_docs.py, tests/test_api_load.py).

Public names, by use (each has its own docstring; runnable scripts in ``examples/``):

* The layer. ``attention(embed_dim, num_heads, kernel=, positional=, causal=, ...)`` -> an
  ``Attention`` module ``[b, N, D] -> [b, N, D]``; ``attention_config(...)`` (same keywords)
  -> the ``AttentionConfig`` that models take. The records underneath:
  ``AttentionConfig(num_heads, head_dim, embed_dim, kernel=KernelSpec("sikf"),
  positional=(PositionalSpec.make("fastrpb", {"per_head": True}),), causal=True)``;
  ``KernelSpec`` is ``Kernel``, the one record of a kernel (name, options, feature map).
* Models. ``DecoderLM(cfg, vocab_size, num_layers, mlp_dim)``: token ids ``[b, N]`` (or
  ``{"inputs": ids, "mask": mask}``) -> float32 logits ``[b, N, vocab]``; ``Classifier(cfg,
  vocab_size, num_layers, mlp_dim, num_classes=2)`` -> ``[b, classes]``; ``DualEncoder`` (two
  documents, ``inputs2``); ``Tower(cfg, num_layers, mlp_dim)``: embeddings ``[b, N, D]`` ->
  states ``[b, N, D]``; ``Block(cfg, mlp_dim)``: one layer ``[b, N, D] -> [b, N, D]``;
  ``build_model(config.model, task_info)`` from a config. One call convention: the input
  first, the rest by keyword (``mask=``, ``train=``); ``Attention``, ``Block`` and ``Tower``
  return an array and take one example ``[N, D]`` as a batch of one.
* Schemes and kernels. ``scheme_names()``, ``kernel_names()``, ``scheme_options("fastrpb")``
  (``{option: Option}``; ``python -m fastpos.positional.compatibility --options`` prints them
  all); ``register_scheme(cls)`` adds a ``Scheme`` subclass (options declared as ``Option``)
  from outside the package (``examples/custom_scheme.py``).
* Trained runs. ``load(workdir, step=None)`` -> ``Loaded`` (``model, params, config, task``);
  ``generate(model, params, prompt [b, P], num_tokens)`` -> tokens ``[b, num_tokens]``;
  ``CachedDecoding(module, max_length)`` decodes your own causal model token by token
  (``examples/own_model.py``); ``train_and_evaluate(config, workdir)`` and
  ``evaluate(config, workdir, split)`` are what ``train.py`` / ``eval.py`` run.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public name -> the module that defines it (imported on first access).
_PUBLIC = {
    # The attention layer and its records.
    "attention": "fastpos.api.layers",
    "attention_config": "fastpos.api.layers",
    "Attention": "fastpos.models.attention",
    "AttentionConfig": "fastpos.models.attention",
    "KernelSpec": "fastpos.models.attention",
    "Kernel": "fastpos.ops.features",
    "PositionalSpec": "fastpos.models.attention",
    # Models and their building blocks.
    "Block": "fastpos.models.blocks",
    "Tower": "fastpos.models.transformer",
    "Classifier": "fastpos.models.transformer",
    "DualEncoder": "fastpos.models.transformer",
    "DecoderLM": "fastpos.models.transformer",
    "build_model": "fastpos.models",
    # Schemes and kernels: names, options, extension.
    "scheme_names": "fastpos.api.extend",
    "kernel_names": "fastpos.api.extend",
    "Scheme": "fastpos.positional.base",
    "Option": "fastpos.positional.base",
    "register_scheme": "fastpos.api.extend",
    "scheme_options": "fastpos.api.extend",
    # Trained runs, sampling and decoding.
    "load": "fastpos.api.loading",
    "Loaded": "fastpos.api.loading",
    "generate": "fastpos.api.generation",
    "CachedDecoding": "fastpos.api.stack_decoding",
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
