"""fastpos.models: the attention layer, the block and the models, built from a config.

``build_model(model_cfg, task)`` is the one entry point: it validates the kernel, the
positional schemes, their options and their compatibility before any parameter exists.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections

from fastpos import positional
from fastpos.models.attention import Attention, AttentionConfig, KernelSpec, PositionalSpec
from fastpos.models.blocks import NORMS, REMAT_POLICIES, Block, remat_policy
from fastpos.models.config import model_config
from fastpos.models.transformer import (
    POOLINGS,
    Classifier,
    DecoderLM,
    DualEncoder,
    Tower,
)
from fastpos.tasks.info import TaskInfo

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


def _options(cfg) -> dict:
  opts = cfg.get("positional_options", None)
  if opts is None:
    return {}
  return opts.to_dict() if isinstance(opts, ml_collections.ConfigDict) else dict(opts)


def attention_config(cfg, task: TaskInfo) -> AttentionConfig:
  """The static attention description of ``cfg`` (``config.model``) for ``task``."""
  names = positional.parse_names(cfg.positional)
  opts = _options(cfg)
  for key in opts:
    if key not in names:
      raise ValueError(
          f"positional_options has options for {key!r}, which is not in model.positional="
          f"{cfg.positional!r}."
      )
  kopts = cfg.get("kernel_options", None)
  kopts = kopts.to_dict() if isinstance(kopts, ml_collections.ConfigDict) else dict(kopts or {})
  kernel = KernelSpec.from_config(cfg.kernel, kopts)
  if cfg.embed_dim % cfg.num_heads and not cfg.get("head_dim", 0):
    raise ValueError(
        f"embed_dim={cfg.embed_dim} is not divisible by num_heads="
        f"{cfg.num_heads}; set head_dim."
    )
  head_dim = cfg.get("head_dim", 0) or cfg.embed_dim // cfg.num_heads
  pooling = cfg.get("pooling", "mean")
  if pooling not in POOLINGS:
    raise ValueError(f"unknown pooling {pooling!r}; valid choices: {', '.join(POOLINGS)}.")
  # Image tasks: the schemes see the grid (2D positions) unless use_grid=False, which treats
  # the image as its raster sequence (1D schemes; PermuteFormer's "w/o 2D rel. pos.").
  grid = tuple(task.grid) if task.grid is not None and cfg.get("use_grid", True) else None
  if pooling == "cls" and grid is not None:
    raise ValueError(
        "pooling='cls' prepends a token, which breaks the image grid "
        f"{grid}; use pooling='mean' for 2D tasks (or model.use_grid=False)."
    )
  max_length = cfg.get("max_length", 0) or task.max_length
  if max_length <= 0:
    raise ValueError("model.max_length is 0 and the task gives no max_length.")
  if pooling == "cls" and task.kind != "lm":
    max_length += 1
  chunk_size = cfg.get("chunk_size", 0)
  if not isinstance(chunk_size, int) or chunk_size < 0:
    raise ValueError(
        f"model.chunk_size must be an int >= 0 (0 picks it from the shape); " f"got {chunk_size!r}."
    )
  return AttentionConfig(
      num_heads=cfg.num_heads,
      head_dim=head_dim,
      embed_dim=cfg.embed_dim,
      kernel=kernel,
      positional=tuple(PositionalSpec.make(n, opts.get(n)) for n in names),
      max_length=max_length,
      grid=grid,
      causal=task.kind == "lm",
      chunk_size=chunk_size or None,
      attn_chunk=cfg.get("attn_chunk", 0),
      mode=cfg.get("attention_mode", "auto"),
  )


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
      logits = model.apply(model.init(jax.random.key(0), ids), ids)   # [2, 3] float32
  """
  if cfg.norm not in NORMS:
    raise ValueError(f"unknown norm {cfg.norm!r}; valid choices: {', '.join(NORMS)}.")
  if cfg.dtype not in DTYPES:
    raise ValueError(f"unknown dtype {cfg.dtype!r}; valid choices: {', '.join(DTYPES)}.")
  attn = attention_config(cfg, task)
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
    "attention_config",
    "build_model",
    "model_config",
]
