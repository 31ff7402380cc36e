"""The kernel registry (fastpos.ops.features.get_kernel): every entry is tested, and what each
entry claims (sign, output size, projection, options, softmax estimation) holds in behaviour."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos import config_schema, positional
from fastpos.models.attention import AttentionConfig, KernelSpec, PositionalSpec
from fastpos.ops import attention as attn_ops
from fastpos.ops import features as F
from fastpos.positional import compatibility
from tests.ops import test_features

B, L, H, D, M = 2, 5, 3, 4, 6


def _x(seed, scale=1.0):
  return np.random.default_rng(seed).normal(size=(B, L, H, D)) * scale


def _mask():
  mask = np.ones((B, L), bool)
  mask[1, 3:] = False
  return jnp.asarray(mask)


def test_every_kernel_has_a_dense_check():
  # Feature maps: a numpy reference in test_features (run by test_registered_map_matches_numpy);
  # the one kernel without a map is softmax, checked densely below.
  assert sorted(test_features._NUMPY) == sorted(F.FEATURE_MAPS)
  assert [n for n in F.KERNELS if F.get_kernel(n).is_softmax] == ["softmax"]
  assert F.KERNELS == ("softmax",) + F.FEATURE_MAPS == compatibility.KERNELS


def test_softmax_matches_dense_numpy():
  q, k, v = (np.random.default_rng(s).normal(size=(B, L, H, D)) for s in (1, 2, 3))
  mask = np.asarray(_mask())
  out = np.asarray(
      attn_ops.softmax_attention(
          jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=jnp.asarray(mask), scale=D**-0.5
      )
  )
  logits = np.einsum("bihd,bjhd->bhij", q, k) * D**-0.5
  logits = np.where(mask[:, None, None, :], logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  np.testing.assert_allclose(out, np.einsum("bhij,bjhd->bihd", weights, v), rtol=1e-12)


@pytest.mark.parametrize("name", F.KERNELS)
def test_entry_facts_hold(name):
  entry = F.get_kernel(name)
  assert entry.name == name and set(entry.options) <= set(F.OPTION_DEFAULTS)
  w = F.make_projection(name, jax.random.PRNGKey(0), M, D, dtype=jnp.float64)
  assert (w is not None) == entry.needs_projection == F.needs_projection(name)
  # The random kernels, and only they, read num_features, redraw and seed.
  for option in ("num_features", "redraw", "seed"):
    assert (option in entry.options) == entry.needs_projection, option
  if entry.is_softmax:
    assert F.feature_dim(name, D, num_features=M) == D and entry.nonnegative
    assert not entry.estimates_softmax and entry.options == ()
    return
  assert w is None or w.shape == (M, D)
  assert "eps" in entry.options  # every linear kernel has the denominator guard
  x = jnp.asarray(_x(0))
  if entry.needs_projection:
    with pytest.raises(ValueError, match="needs a projection"):
      F.feature_map(name, x)
  else:
    with pytest.raises(ValueError, match="takes no projection"):
      F.feature_map(name, x, projection=jnp.zeros((M, D)))
  signs = []
  for scale in (1.0, 3.0):
    for is_query in (True, False):
      for nu in (1, 2):
        out = np.asarray(
            F.feature_map(
                name,
                jnp.asarray(_x(1, scale)),
                projection=w,
                is_query=is_query,
                mask=_mask(),
                nu=nu,
            )
        )
        size = F.feature_dim(name, D, num_features=M, nu=nu)
        sized = dataclasses.replace(entry, num_features=M, nu=nu)
        assert out.shape == (B, L, H, size) and size == sized.feature_dim(D)
        assert not np.any(np.isnan(out))
        signs.append(np.any(out < 0))
  # The sign claim: never negative when claimed; a signed map shows negative features.
  assert any(signs) == (not entry.nonnegative)
  # nu matters exactly for the kernels that read it (output size and values).
  sizes = {F.feature_dim(name, D, num_features=M, nu=nu) for nu in (1, 2)}
  assert (len(sizes) == 2) == ("nu" in entry.options)
  # num_features sets the output size exactly for the kernels that read it.
  if entry.needs_projection:
    assert F.feature_dim(name, D, num_features=M + 1) != F.feature_dim(name, D, num_features=M)


# m = 2^16 features, |q|, |k| in [0.3, 0.8]: test_features' tolerance for one query's weights
# (a ratio of two estimates) against softmax's, 5%.
@pytest.mark.parametrize("name", [n for n in F.FEATURE_MAPS if F.get_kernel(n).estimates_softmax])
def test_softmax_estimators_estimate_softmax(name):
  q, k = test_features._pairs(0.3, 0.8)
  q = np.broadcast_to(q[:, :1], k.shape)
  w = F.make_projection(
      name, jax.random.PRNGKey(13), test_features.NUM_FEATURES, q.shape[-1], dtype=jnp.float64
  )
  phi_q = F.feature_map(name, jnp.asarray(q), projection=w, is_query=True)
  phi_k = F.feature_map(name, jnp.asarray(k), projection=w, is_query=False)
  a = np.asarray(test_features._attn(phi_q, phi_k))[0, 0, 0]
  logits = np.sum(q[0, 0, 0] * k[0, :, 0], -1)
  softmax = np.exp(logits) / np.sum(np.exp(logits))
  assert np.max(np.abs(a / softmax - 1)) < test_features.UNBIASED_RTOL


def test_option_defaults_are_shared():
  spec = KernelSpec()
  assert {o: getattr(spec, o) for o in F.OPTION_DEFAULTS} == dict(F.OPTION_DEFAULTS)
  assert config_schema.model_config().kernel_options.to_dict() == dict(F.OPTION_DEFAULTS)
  assert F.get_kernel("dpfp").defaults == {"nu": 1, "eps": 1e-6}


def test_unknown_kernel_and_option_name_the_choices():
  for call in (
      lambda: F.get_kernel("elu2"),
      lambda: KernelSpec("elu2"),
      lambda: compatibility.problem("elu2", "none"),
  ):
    with pytest.raises(ValueError) as info:
      call()
    assert "'elu2'" in str(info.value) and ", ".join(F.KERNELS) in str(info.value)
  with pytest.raises(ValueError) as info:
    F.feature_map("softmax", jnp.asarray(_x(0)))
  assert "'softmax'" in str(info.value) and ", ".join(F.FEATURE_MAPS) in str(info.value)
  with pytest.raises(ValueError) as info:
    KernelSpec.from_config("favor", {"num_feature": 3})
  msg = str(info.value)
  for fragment in (
      "'num_feature'",
      "kernel 'favor'",
      "num_features=64",
      "eps=1e-06",
      "redraw=False",
      "seed=0",
      "unused by 'favor': nu",
  ):
    assert fragment in msg, (fragment, msg)
  with pytest.raises(ValueError, match="'softmax' takes: \\(none\\)"):
    KernelSpec.from_config("softmax", {"nu_": 2})
  # Options of other kernels are accepted (one config block serves every kernel).
  assert KernelSpec.from_config("sikf", {"num_features": 8, "nu": 2}).num_features == 8


def test_one_kernel_record(monkeypatch):
  """The layer's KernelSpec, the schemes' KernelInfo and the ops' Kernel are one class, and the
  very record a config holds is what its schemes' Dims and compatibility rules see."""
  assert KernelSpec is F.Kernel is positional.KernelInfo
  seen = []
  cls = positional.get_class("kernelized_rpe")
  rule = cls.compatibility

  def spy(kernel, **kw):
    seen.append(kernel)
    return rule(kernel, **kw)

  monkeypatch.setattr(cls, "compatibility", spy)
  kernel = KernelSpec("favor", num_features=8)
  cfg = AttentionConfig(
      num_heads=2,
      head_dim=4,
      embed_dim=8,
      kernel=kernel,
      positional=(PositionalSpec.make("rope", {}), PositionalSpec.make("kernelized_rpe", {})),
      max_length=8,
  )
  assert seen and all(k is kernel for k in seen)
  assert [d.kernel for d in cfg.scheme_dims().values()] == [kernel, kernel]
  assert all(d.kernel is kernel for d in cfg.scheme_dims().values())
  # A name and a record answer alike; an incompatible pair names the kernel, not the record.
  for name in F.KERNELS:
    for scheme in ("rope", "t5_bias", "kernelized_rpe"):
      setting = dict(causal=True, two_d=False)
      assert compatibility.problem(name, scheme, **setting) == compatibility.problem(
          F.Kernel(name), scheme, **setting
      )
  with pytest.raises(ValueError, match="kernel 'favor' x positional scheme 't5_bias'"):
    compatibility.plan(kernel, ["t5_bias"])


@pytest.mark.parametrize("name", F.FEATURE_MAPS)
def test_feature_maps_are_typed_callables(name):
  """Each map says which named arguments its function takes, and they are its parameters."""
  fmap = F.get_kernel(name).map
  assert isinstance(fmap, F.FeatureMap) and set(fmap.reads) <= set(F.MAP_ARGUMENTS)
  params = list(inspect.signature(getattr(fmap.fn, "__wrapped__", fmap.fn)).parameters)
  assert params[0] == "x" and set(fmap.reads) <= set(params), (fmap.reads, params)
  assert ("projection" in fmap.reads) == F.get_kernel(name).needs_projection
  if "projection" in fmap.reads:
    assert params[1] == "projection"  # passed as the second argument
  with pytest.raises(ValueError, match="'scale'"):
    F.FeatureMap(fmap.fn, reads=("scale",))
