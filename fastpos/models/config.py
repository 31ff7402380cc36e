"""The model's part of a config: ``model_config()``, the base of every experiment's
``config.model``, each field commented."""

from __future__ import annotations

import ml_collections


def model_config() -> ml_collections.ConfigDict:
  """The base model config (LRA's small encoder: 4 layers, width 256, 4 heads)."""
  c = ml_collections.ConfigDict()
  # Attention similarity: "softmax" or a feature map of fastpos.ops.features.FEATURE_MAPS
  # (elu1, relu, sikf, dpfp, favor, prf, trf, nprf, orf).
  c.kernel = "softmax"
  # Feature-map options: random features m (favor/prf/trf/nprf/orf), DPFP's nu, the
  # denominator guard, and whether random projections are redrawn every training step.
  c.kernel_options = ml_collections.ConfigDict(
      dict(num_features=64, nu=1, eps=1e-6, redraw=False, seed=0)
  )
  # Positional schemes, comma-separated, applied in this order at their hooks
  # (fastpos.positional.SCHEMES; "none" for no positional information). `python -m
  # fastpos.positional.compatibility` prints which kernels each works with.
  c.positional = "none"
  # Per-scheme options, by scheme name: {scheme: {option: value}}; a scheme's options are
  # the fields of its class in fastpos.positional (unset ones keep the class defaults). In a
  # config file: c.model.positional_options.fastrpb = {"per_head": True}; on the command line
  # one option at a time: --config.model.positional_options.fastrpb.per_head=True (train.py
  # creates the scheme's block and checks the option's name and type).
  c.positional_options = ml_collections.ConfigDict()
  c.num_layers = 4
  c.embed_dim = 256  # D, the model width
  c.num_heads = 4
  c.head_dim = 0  # 0 means embed_dim // num_heads
  c.mlp_dim = 1024
  c.dropout_rate = 0.1
  c.norm = "post"  # "post" (LRA's layout) or "pre" LayerNorm; "batch" = post BatchNorm
  c.pooling = "mean"  # encoder pooling: "mean" over real tokens or "cls" (a prepended token)
  # Longest sequence the positional tables serve; 0 means the task's max_length.
  c.max_length = 0
  c.dtype = "float32"  # activations: "float32" or "bfloat16" (params stay float32)
  c.tie_embeddings = True  # lm only: output projection = input embedding transposed
  c.memory_length = 0  # lm only: Transformer-XL memory M (needs the transformer_xl scheme)
  # Causal linear attention chunk; 0 picks it from the feature and value sizes
  # (fastpos.ops.attention.causal_chunk_size: 64, or 32 for large feature maps).
  c.chunk_size = 0
  # Image tasks: True gives the positional schemes the task's grid (2D positions); False
  # treats the image as its raster sequence (1D schemes, e.g. SPE, or PermuteFormer's
  # "w/o 2D rel. pos." ablation).
  c.use_grid = True
  # What each block keeps for its backward pass (fastpos.models.blocks.REMAT_POLICIES): "none"
  # (everything autodiff saves), "block" (only the block's input; the rest is recomputed),
  # "save_matmuls" (the outputs of the projections/MLP matmuls; the rest is recomputed).
  # Changes memory and time, never the numbers.
  c.remat = "none"
  # Run the layers as one nn.scan body (parameters stacked on a leading layer axis under
  # "layers"): compile time flat in depth, and the remat policy honoured on every backend.
  # Changes the parameter tree (checkpoints of one layout do not load into the other).
  c.scan_layers = False
  # Tokens per chunk of each block's token-wise part (dropout, residual, norms, MLP), run
  # chunk by chunk and rematerialised; 0: the whole sequence at once. Changes memory and
  # time, not the function (dropout masks included); not with norm="batch".
  c.mlp_chunk = 0
  return c
