"""fastpos.models: the attention layer, the block and the models, built from a config.

``build_model(model_cfg, task)`` is the one entry point: it validates the kernel, the
positional schemes, their options and their compatibility before any parameter exists.
"""

from __future__ import annotations

import jax.numpy as jnp

from fastpos.config_schema import model_config
from fastpos.models.attention import Attention, AttentionConfig, KernelSpec, PositionalSpec
from fastpos.models.blocks import REMAT_POLICIES, Block, remat_policy
from fastpos.models.transformer import (
    Classifier,
    DecoderLM,
    DualEncoder,
    Tower,
)
from fastpos.tasks.info import TaskInfo

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


def build_model(cfg, task: TaskInfo):
  """The model of ``cfg`` (``config.model``) for ``task`` (a ``TaskInfo``: its kind picks
  ``Classifier``, ``DualEncoder`` or ``DecoderLM``; its vocabulary, classes, length and grid
  size it). Raises ValueError on bad names, options or incompatible kernel x scheme pairs
  (before any compute).

  Example::

      from fastpos import config_schema
      from fastpos.tasks.info import TaskInfo

      cfg = config_schema.model_config()                   # the base config.model
      cfg.update(kernel="elu1", positional="rope", num_layers=1, embed_dim=16, mlp_dim=32)
      task = TaskInfo(kind="classify", vocab_size=50, num_classes=3, max_length=12)
      model = fastpos.build_model(cfg, task)               # a Classifier
      ids = jnp.ones((2, 12), jnp.int32)                   # [batch, N] int token ids
      variables = jax.jit(model.init)(jax.random.key(0), ids)        # jitted: one program
      logits = jax.jit(model.apply)(variables, ids)                  # [2, 3] float32
  """
  if cfg.dtype not in DTYPES:
    raise ValueError(f"unknown dtype {cfg.dtype!r}; valid choices: {', '.join(DTYPES)}.")
  attn = AttentionConfig.from_model_config(cfg, task)
  remat = cfg.get("remat", "none")
  remat_policy(remat)  # raises naming the valid choices
  scan_layers = cfg.get("scan_layers", False)
  if not isinstance(scan_layers, bool):
    raise ValueError(f"model.scan_layers must be a bool; got {scan_layers!r}.")
  shared = [s.name for s in attn.positional if s.option_dict().get("share_across_layers")]
  if scan_layers and shared:
    # nn.scan would stack the shared table per layer: one table for all layers is not scanned.
    raise ValueError(
        f"model.scan_layers=True cannot share a scheme across layers "
        f"(share_across_layers of {', '.join(shared)}); set model.scan_layers="
        "False (model.remat works without it) or share_across_layers=False."
    )
  common = dict(
      attention=attn,
      vocab_size=task.vocab_size,
      num_layers=cfg.num_layers,
      mlp_dim=cfg.mlp_dim,
      dropout_rate=cfg.dropout_rate,
      norm=cfg.norm,
      dtype=DTYPES[cfg.dtype],
      remat=remat,
      scan_layers=scan_layers,
      mlp_chunk=cfg.get("mlp_chunk", 0),
  )
  memory_length = cfg.get("memory_length", 0)
  pooling = cfg.get("pooling", "mean")
  if memory_length and task.kind != "lm":
    raise ValueError("memory_length > 0 (Transformer-XL memory) is for lm tasks only.")
  if task.kind == "lm":
    if pooling != "mean":
      raise ValueError(
          f"model.pooling={pooling!r} is for encoders (classify / retrieval "
          f"tasks); a language model has no pooling: leave it at 'mean'."
      )
    return DecoderLM(
        **common, tie_embeddings=cfg.get("tie_embeddings", True), memory_length=memory_length
    )
  if task.num_classes < 2:
    raise ValueError(f"a {task.kind} task needs num_classes >= 2; got {task.num_classes}.")
  return (DualEncoder if task.kind == "retrieval" else Classifier)(
      **common, pooling=pooling, num_classes=task.num_classes
  )


__all__ = [
    "REMAT_POLICIES",
    "Attention",
    "AttentionConfig",
    "Block",
    "Classifier",
    "DecoderLM",
    "DualEncoder",
    "KernelSpec",
    "PositionalSpec",
    "TaskInfo",
    "Tower",
    "build_model",
    "model_config",
]
