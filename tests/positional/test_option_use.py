"""Every scheme option that some setting ignores declares it (``Option.used_when``) and is
refused there: each case below is held both ways. Where an option is refused, building the
layer anyway (the refusal bypassed) gives outputs bit-identical to the default's, so the
declaration is true; where it is accepted, it changes the outputs."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from fastpos import positional
from fastpos.models import Attention, AttentionConfig, KernelSpec, PositionalSpec
from tests.helpers import nudged

W, HEADS, N = 16, 2, 12

# (scheme, kernel, causal, options of the setting, option, a non-default value, used?)
CASES = [
    ("lrpe", "elu1", False, {"type": 3}, "learnable_theta", False, False),
    ("lrpe", "elu1", False, {"type": 3}, "base", 100.0, False),
    ("lrpe", "elu1", False, {"type": 2}, "base", 100.0, True),
    ("lrpe", "elu1", False, {"p": "identity"}, "learnable_p", False, False),
    ("lrpe", "elu1", False, {"p": "permutation"}, "learnable_p", False, False),
    ("lrpe", "elu1", False, {}, "learnable_p", False, True),
    ("lrpe", "elu1", False, {}, "seed", 3, False),  # householder v learned
    ("lrpe", "elu1", False, {"p": "fourier"}, "seed", 3, False),
    ("lrpe", "elu1", False, {"learnable_p": False}, "seed", 3, True),
    ("lrpe", "elu1", False, {"p": "random_permutation"}, "seed", 3, True),
    ("lrpe", "elu1", False, {"type": 3, "p": "identity"}, "seed", 3, True),
    (
        "lrpe",
        "elu1",
        False,
        {"p": "identity", "learnable_theta": False},
        "per_head",
        True,
        False,
    ),
    ("lrpe", "elu1", False, {"p": "random_permutation"}, "per_head", True, True),
    ("lrpe", "elu1", False, {"type": 3, "p": "identity"}, "per_head", True, True),
    ("permuteformer", "relu", True, {"permute": False, "decay": 0.9}, "seed", 3, False),
    ("permuteformer", "relu", True, {}, "seed", 3, True),
    ("t5_bias", "softmax", False, {"bucketed": False}, "num_buckets", 8, False),
    ("t5_bias", "softmax", False, {"bucketed": False}, "max_distance", 8, False),
    ("t5_bias", "softmax", False, {}, "num_buckets", 8, True),
    ("t5_bias", "softmax", False, {"num_buckets": 8}, "max_distance", 5, True),
]
# The accepted cases run with the slow tests (the refusals are the default run's).
PARAMS = [
    pytest.param(*c, id=f"{c[0]}-{c[4]}-{'used' if c[6] else 'ignored'}-{i}")
    if not c[6]
    else pytest.param(*c, id=f"{c[0]}-{c[4]}-used-{i}", marks=pytest.mark.slow)
    for i, c in enumerate(CASES)
]


def _cfg(scheme: str, kernel: str, causal: bool, options: dict) -> AttentionConfig:
  return AttentionConfig(
      kernel=KernelSpec(kernel, num_features=8),
      positional=(PositionalSpec.make(scheme, options),),
      causal=causal,
      num_heads=HEADS,
      head_dim=W // HEADS,
      embed_dim=W,
      max_length=N,
  )


def _outputs(cfg: AttentionConfig) -> np.ndarray:
  x = jax.random.normal(jax.random.key(0), (2, N, W))
  layer = Attention(cfg)
  params = layer.init(jax.random.key(1), x)
  # Learned parameters nudged off their init, so that one set per head can differ.
  params = nudged(params)
  return np.asarray(layer.apply(params, x))


@pytest.mark.parametrize("scheme, kernel, causal, base, name, value, used", PARAMS)
def test_an_option_is_refused_exactly_where_it_is_ignored(
    monkeypatch, scheme, kernel, causal, base, name, value, used
):
  cls = positional.get_class(scheme)
  assert value != cls.option_spec[name].default
  options = {**base, name: value}
  assert (cls.unused_options(options, two_d=False) == [name]) is not used
  if not used:
    with pytest.raises(ValueError, match=f"option {name}={value!r} would be ignored") as e:
      _cfg(scheme, kernel, causal, options)
    assert cls.option_spec[name].used_doc in str(e.value)
    monkeypatch.setattr(cls, "unused_options", classmethod(lambda c, o, two_d: []))
  default = _outputs(_cfg(scheme, kernel, causal, base))
  changed = _outputs(_cfg(scheme, kernel, causal, options))
  assert np.array_equal(default, changed) is not used, np.max(np.abs(default - changed))


def test_every_option_a_setting_ignores_is_covered():
  declared = {
      (s, n)
      for s, cls in positional.SCHEMES.items()
      for n, o in cls.option_spec.items()
      if o.used_when is not None and s not in ("fastrpb", "spe")  # tested with the layers
  }
  assert declared == {(c[0], c[4]) for c in CASES if not c[6]}
