"""The public API (``fastpos.__all__``): a light import, every name resolves and is documented,
the flat layer keywords build the records the models use (and refuse what they would
ignore), ``CachedDecoding`` equals the full causal forward of a user's own stack,
``generate`` equals the full forward of what it sampled, and ``register_scheme`` / the options
table."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastpos
from fastpos import positional
from fastpos.models.attention import AttentionConfig, KernelSpec, PositionalSpec
from fastpos.positional import compatibility, option_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W, H, N, VOCAB = 16, 2, 12, 23


def test_import_fastpos_loads_no_jax_flax_or_numpy():
  code = (
      "import sys, fastpos, fastpos.config_schema; "
      "print(sorted(m for m in ('jax', 'flax', 'numpy') if m in sys.modules)); "
      "print(fastpos.__file__)"
  )
  out = subprocess.run(
      [sys.executable, "-c", code],
      capture_output=True,
      text=True,
      cwd=ROOT,
      env={**os.environ, "PYTHONPATH": ROOT},
      timeout=120,
  )
  assert out.returncode == 0, out.stderr
  loaded, path = out.stdout.splitlines()
  assert loaded == "[]"
  assert path == os.path.join(ROOT, "fastpos", "__init__.py")


def test_every_public_name_resolves_and_is_documented():
  assert fastpos.__all__ == sorted(set(fastpos.__all__))
  assert set(fastpos.__all__) <= set(dir(fastpos))
  for name in fastpos.__all__:
    obj = getattr(fastpos, name)
    assert (obj.__doc__ or "").strip(), f"fastpos.{name} has no docstring"
    assert re.search(rf"\b{name}\b", fastpos.__doc__), f"the package docstring omits {name}"
  with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
    fastpos.not_a_name  # noqa: B018


def test_flat_keywords_build_the_nested_records():
  flat = fastpos.attention_config(
      32,
      4,
      kernel="favor",
      positional="rope,fastrpb",
      causal=True,
      max_length=64,
      num_features=16,
      seed=3,
      fastrpb={"per_head": True},
  )
  nested = AttentionConfig(
      num_heads=4,
      head_dim=8,
      embed_dim=32,
      kernel=KernelSpec("favor", num_features=16, seed=3),
      positional=(PositionalSpec.make("rope"), PositionalSpec.make("fastrpb", {"per_head": True})),
      max_length=64,
      causal=True,
  )
  assert flat == nested
  assert fastpos.attention_config(
      32, 4, options={"rope": {"base": 500.0}}, positional=["rope"]
  ) == (fastpos.attention_config(32, 4, positional=("rope",), rope={"base": 500.0}))
  layer = fastpos.attention(32, 4, kernel="elu1", positional="rope", name="attn")
  assert isinstance(layer, fastpos.Attention) and layer.name == "attn"


@pytest.mark.parametrize(
    "keywords, message",
    [
        (dict(kernel="elu"), "kernel must be one of softmax, elu1, relu"),
        (dict(kernel="elu1", num_features=8), "kernel 'elu1' takes no option 'num_features'"),
        (dict(positional="rope", fastrpb={}), "options given for positional scheme 'fastrpb'"),
        (dict(positional="rope", rope=True), "rope= must be a dict of 'rope''s options"),
        (dict(positional="rope", rope={"bas": 1.0}), "unknown option 'bas'.*valid options: base"),
        (dict(positional="rope", rope={"base": -1.0}), "rope: base must be a finite number > 0"),
        (dict(positional="nope"), "unknown positional scheme 'nope'; valid choices: none"),
        (dict(positional=[1]), "positional must be a scheme name"),
        (
            dict(positional="rope", options={"rope": {}}, rope={}),
            "options for 'rope' given twice",
        ),
        (dict(kernel="elu1", positional="t5_bias"), "kernel 'elu1' x positional scheme 't5_bias'"),
        (dict(positional="absolute"), "scheme 'absolute' acts at the embed hook"),
        (dict(max_length=0), "fastpos.attention: max_length must be an integer >= 1; got 0"),
    ],
)
def test_flat_keywords_refuse_bad_values(keywords, message):
  with pytest.raises(ValueError, match=message):
    fastpos.attention(W, H, **keywords)


def test_width_not_divisible_by_heads_names_head_dim():
  with pytest.raises(
      ValueError, match="embed_dim=10 is not divisible by num_heads=4; give head_dim"
  ):
    fastpos.attention_config(10, 4)
  assert fastpos.attention_config(10, 4, head_dim=3).head_dim == 3


@pytest.mark.slow  # the layer's own tests hold every cell to its references; this is the flat door
def test_flat_layer_matches_its_dense_reference():
  """float64, causal, a padded row: the fast path against the layer's dense references."""
  layer = fastpos.attention(
      W, H, kernel="elu1", positional=("rope", "fastrpb"), causal=True, max_length=N,
      dtype=jnp.float64,
  )  # fmt: skip
  x = jax.random.normal(jax.random.key(0), (2, N, W), jnp.float64)
  mask = jnp.arange(N)[None, :] < jnp.array([[N], [7]])
  variables = jax.tree.map(lambda a: a.astype(jnp.float64), layer.init(jax.random.key(1), x))
  fast = layer.apply(variables, x, mask=mask)
  dense = layer.apply(variables, x, mask=mask, reference=True)
  real = np.asarray(mask)[..., None]
  err = np.max(np.abs(np.asarray(fast - dense) * real)) / np.max(np.abs(np.asarray(dense)))
  assert err < 1e-9, err


class _Stack(nn.Module):
  """A user's causal model: embed, two fastpos attention layers with MLPs, a head."""

  kernel: str
  schemes: tuple

  @nn.compact
  def __call__(self, tokens, mask=None, decode=None):
    f64 = dict(dtype=jnp.float64, param_dtype=jnp.float64)
    x = nn.Embed(VOCAB, W, **f64)(tokens)
    for _ in range(2):
      attn = fastpos.attention(
          W,
          H,
          kernel=self.kernel,
          positional=self.schemes,
          causal=True,
          max_length=N,
          dtype=jnp.float64,
      )
      x = x + attn(x, mask=mask, decode=decode)
      x = x + nn.Dense(W, **f64)(jnp.tanh(x))
    return nn.Dense(VOCAB, **f64)(x)


# Slow; the default run keeps CachedDecoding's example (tests/test_api_docs.py) and decoding equal
# to the full forward (tests/models/test_decoding.py).
@pytest.mark.slow
@pytest.mark.parametrize(
    "kernel, schemes", [("softmax", ("rope", "t5_bias")), ("elu1", ("fastrpb",))]
)
def test_cached_decoding_of_a_users_stack_equals_its_full_forward(kernel, schemes):
  """A left-padded prompt of 5, then one token per step; float64, every real position."""
  model = _Stack(kernel, schemes)
  tokens = jax.random.randint(jax.random.key(1), (2, N), 1, VOCAB)
  mask = jnp.ones((2, N), bool).at[1, :2].set(False)  # row 1: two pad slots before its prompt
  tokens = jnp.where(mask, tokens, 0)
  params = jax.jit(model.init)(jax.random.key(0), tokens)
  full = jax.jit(model.apply)(params, tokens, mask=mask)
  dec = fastpos.CachedDecoding(model, max_length=N)
  state = dec.init(tokens[:, :1])
  step = jax.jit(dec.step)
  out, state = step(params, state, tokens[:, :5], mask=mask[:, :5])
  outs = [out]
  for i in range(5, N):
    out, state = step(params, state, tokens[:, i : i + 1], mask=mask[:, i : i + 1])
    outs.append(out)
  assert int(state["index"]) == N
  got = np.asarray(jnp.concatenate(outs, axis=1))
  real = np.asarray(mask)[..., None]
  err = np.max(np.abs((got - np.asarray(full)) * real)) / np.max(np.abs(np.asarray(full)))
  assert err < 1e-9, err


def test_cached_decoding_refusals():
  class NoDecode(nn.Module):

    @nn.compact
    def __call__(self, x, decode=None):
      return nn.Dense(4)(x)

  with pytest.raises(ValueError, match="NoDecode made no decoding cache: its __call__ must pass"):
    fastpos.CachedDecoding(NoDecode(), 8).init(jnp.ones((1, 1, 4)))
  with pytest.raises(ValueError, match="max_length must be an int >= 1; got 0"):
    fastpos.CachedDecoding(NoDecode(), 0)
  with pytest.raises(ValueError, match="takes a Flax linen module; got str"):
    fastpos.CachedDecoding("model", 8)


@pytest.fixture(scope="module")
def lm():
  cfg = fastpos.attention_config(W, H, kernel="elu1", positional="rope", causal=True, max_length=N)
  model = fastpos.DecoderLM(cfg, vocab_size=VOCAB, num_layers=1, mlp_dim=W, dtype=jnp.float64)
  variables = jax.jit(model.init)(jax.random.key(0), {"inputs": jnp.ones((1, 4), jnp.int32)})
  return model, jax.tree.map(lambda a: a.astype(jnp.float64), variables["params"])


# Slow; the default run keeps generate's example (tests/test_api_docs.py) and decoding equal to the
# full forward (tests/models/test_decoding.py).
@pytest.mark.slow
def test_generate_logits_equal_the_full_forward_of_the_sample(lm):
  model, params = lm
  prompt = jnp.array([[0, 0, 3, 4, 5], [7, 8, 9, 10, 11]])  # row 0 left-padded
  tokens, logits = fastpos.generate(model, params, prompt, 6, seed=2, return_logits=True)
  assert tokens.shape == (2, 6) and logits.shape == (2, 10, VOCAB)
  assert np.all((np.asarray(tokens) >= 1) & (np.asarray(tokens) < VOCAB))
  seq = jnp.concatenate([prompt, tokens[:, :-1]], axis=1)
  full = jax.jit(model.apply)({"params": params}, {"inputs": seq, "mask": seq != 0})
  real = np.asarray(seq != 0)[..., None]
  err = np.max(np.abs(np.asarray(logits - full) * real)) / np.max(np.abs(np.asarray(full)))
  assert err < 1e-9, err
  # The padded row samples what the same prompt unpadded does (greedy, to the same logits).
  alone = fastpos.generate(model, params, jnp.array([3, 4, 5]), 6, temperature=0)
  padded = fastpos.generate(model, params, prompt, 6, temperature=0)
  np.testing.assert_array_equal(np.asarray(padded[0]), np.asarray(alone[0]))
  same = fastpos.generate(model, {"params": params}, prompt, 6, seed=2)  # variables work too
  np.testing.assert_array_equal(np.asarray(same), np.asarray(tokens))


@pytest.mark.parametrize(
    "args, keywords, message",
    [
        ((jnp.array([[1, 2]]), 0), {}, "num_tokens must be an integer >= 1; got 0"),
        ((jnp.array([[1, 2]]), 2), dict(temperature=-1.0), "temperature must be a finite"),
        ((jnp.array([[1, 2]]), 2), dict(top_p=0.0), r"top_p must be a finite number > 0"),
        ((jnp.array([[1, 2]]), 2), dict(top_k=VOCAB + 1), "top_k must be an integer >= 0 and"),
        ((jnp.array([[1, VOCAB]]), 2), {}, f"token id {VOCAB} is out of range"),
        ((jnp.array([[1, 0]]), 2), {}, "must be left-padded"),
        ((jnp.array([[1.0, 2.0]]), 2), {}, "prompt must be integer token ids"),
        ((jnp.array([[1, 2]]), N - 1), {}, f"exceeds the model's max_length {N}"),
    ],
)
def test_generate_refuses_bad_arguments(lm, args, keywords, message):
  model, params = lm
  with pytest.raises(ValueError, match=message):
    fastpos.generate(model, params, *args, **keywords)


def test_generate_needs_a_decoder_lm():
  cfg = fastpos.attention_config(W, H)
  model = fastpos.Classifier(cfg, vocab_size=VOCAB, num_layers=1, mlp_dim=W, num_classes=2)
  with pytest.raises(ValueError, match="causal fastpos.DecoderLM; got Classifier"):
    fastpos.generate(model, {}, jnp.array([[1]]), 2)


def test_options_table_lists_every_option_of_every_scheme(capsys):
  assert compatibility.main(["compatibility", "--options"]) == 0
  text = capsys.readouterr().out
  rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
  want = {(s, o) for s, cls in positional.SCHEMES.items() for o in cls.option_spec}
  got = {tuple(c.strip() for c in r.strip("|").split(" | ")[:2]) for r in rows[1:]}
  assert want <= got
  assert len(option_table.rows()) == len(want)
  assert "| fastrpb | per_head | bool | False | True or False |" in text
  assert "| num_features | 64 | favor, prf, trf, nprf, orf |" in text
  assert fastpos.scheme_options("rope")["base"].default == 10000.0


class _Bias(fastpos.Scheme):
  """A constant logits bias per head (for the registration tests)."""

  scheme_name = "test_bias"
  hooks = ("logits",)
  option_spec = {"value": fastpos.Option(0.5, "the bias", type="number")}

  def logits(self, q, k, ctx):
    return jnp.full((1, 1, q.shape[1], k.shape[1]), self.value, q.dtype)


@pytest.fixture
def registry(monkeypatch):
  """A copy of the scheme registry, restored after the test."""
  monkeypatch.setattr(positional, "SCHEMES", dict(positional.SCHEMES))
  return positional.SCHEMES


def test_register_scheme_makes_a_name_like_the_built_in_ones(registry):
  assert fastpos.register_scheme(_Bias) is _Bias
  assert "test_bias" in fastpos.scheme_names()
  assert option_table.rows()[-1][:4] == ("test_bias", "value", "float", "0.5")
  assert "'test_bias' adds a bias" in compatibility.problem("elu1", "test_bias")
  layer = fastpos.attention(W, H, positional="test_bias", test_bias={"value": 2.0})
  x = jax.random.normal(jax.random.key(0), (1, 5, W))
  # A constant bias cancels in the softmax: the layer equals the one without it.
  plain = fastpos.attention(W, H)
  variables = layer.init(jax.random.key(1), x)
  np.testing.assert_allclose(
      layer.apply(variables, x), plain.apply(variables, x), rtol=1e-4, atol=1e-6
  )
  with pytest.raises(ValueError, match="'test_bias' is already registered"):
    fastpos.register_scheme(type("Other", (_Bias,), {}))


@pytest.mark.parametrize(
    "attrs, message",
    [
        (dict(scheme_name=""), "scheme_name must be a non-empty identifier"),
        (dict(scheme_name="rope"), "'rope' is already registered"),
        (dict(hooks=("bias",)), "hooks must be a tuple of embed, features"),
        (dict(hooks=("output",)), "lists the 'output' hook but does not implement output"),
        (dict(feature_stage="late"), "feature_stage must be one of pre_phi, post_phi"),
    ],
)
def test_register_scheme_refuses_what_breaks_the_contract(registry, attrs, message):
  before = dict(registry)
  with pytest.raises(ValueError, match=message):
    fastpos.register_scheme(type("Bad", (_Bias,), attrs))
  assert registry == before
  with pytest.raises(ValueError, match="takes a subclass of fastpos.Scheme; got 3"):
    fastpos.register_scheme(3)
