"""``nprf``: Luo et al.'s recipe, normalised PRF features with kernelized RPE, as one setting.

Luo et al. (NeurIPS 2021), Sec. 3.3-3.4: positive random features on L2-normalised queries and
keys (``fastpos.ops.features.nprf``: q.k in [-1, 1], so the PRF estimate has bounded variance
and training is stable) combined with the relative table of ``kernelized_rpe`` inside the
numerator and denominator (Eq. 10-13), computed by FFT. It is not a scheme of its own (nothing
is forked): it is the kernel ``nprf`` paired with the scheme ``kernelized_rpe``; ``apply``
writes that pair into a model config. Supports 1D, 2D and causal (the features are positive).
"""

from __future__ import annotations

KERNEL = "nprf"
POSITIONAL = "kernelized_rpe"


def apply(model_cfg, *, num_features: int | None = None, share_across_layers: bool = False):
  """Sets ``model_cfg`` (a ``config.model``) to NPRF + kernelized RPE; returns it."""
  model_cfg.kernel = KERNEL
  model_cfg.positional = POSITIONAL
  if num_features is not None:
    model_cfg.kernel_options.num_features = num_features
  if share_across_layers:
    model_cfg.positional_options[POSITIONAL] = {"share_across_layers": True}
  return model_cfg
