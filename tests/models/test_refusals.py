"""Layers refuse, at construction, what they would silently ignore or get wrong: a scheme whose
hook they do not run, an option the setting ignores, a bidirectional "LM", values out of range.
Each message names the value and what is valid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos import positional
from fastpos.models import (
    Attention,
    AttentionConfig,
    Block,
    Classifier,
    DecoderLM,
    DualEncoder,
    KernelSpec,
    PositionalSpec,
    Tower,
    decoding,
)

W, HEADS, N, VOCAB = 16, 2, 12, 11


def _cfg(*schemes, kernel="softmax", causal=False, grid=None, **extra):
  specs = tuple(
      PositionalSpec.make(s) if isinstance(s, str) else PositionalSpec.make(*s) for s in schemes
  )  # "name" or ("name", options)
  sizes = dict(num_heads=HEADS, head_dim=W // HEADS, embed_dim=W, max_length=N) | extra
  return AttentionConfig(
      kernel=KernelSpec(kernel, num_features=8), positional=specs, causal=causal, grid=grid, **sizes
  )


@pytest.mark.parametrize("layer", ["Attention", "Block"])
def test_an_embed_scheme_inside_a_layer_names_the_tower(layer):
  cfg = _cfg("absolute", "fastrpb")
  build = {"Attention": lambda c: Attention(c), "Block": lambda c: Block(c, mlp_dim=W)}[layer]
  with pytest.raises(ValueError) as e:
    build(cfg)  # construction, before any init or call
  msg = str(e.value)
  assert msg.startswith(f"{layer}: positional scheme 'absolute' acts at the embed hook")
  assert "Tower runs it" in msg and "cfg.attention_only()" in msg
  assert "(the schemes " + layer + " runs: fastrpb)" in msg
  layer_cfg = cfg.attention_only()
  assert [p.name for p in layer_cfg.positional] == ["fastrpb"]
  build(layer_cfg)  # what the message suggests works


def test_the_tower_runs_the_embed_hook_its_blocks_refuse():
  cfg = _cfg("absolute")
  tower = Tower(cfg, num_layers=1, mlp_dim=W)
  x = jax.random.normal(jax.random.key(0), (2, N, W))
  params = jax.jit(tower.init)(jax.random.key(1), x, None)["params"]
  assert "pos_absolute" in params
  y = jax.jit(tower.apply)({"params": params}, x, None)
  bare = Tower(_cfg(), num_layers=1, mlp_dim=W)
  params_bare = {k: v for k, v in params.items() if k != "pos_absolute"}
  y_bare = jax.jit(bare.apply)({"params": params_bare}, x, None)
  assert float(jnp.max(jnp.abs(y - y_bare))) > 1e-3  # the positions changed the output


@pytest.mark.parametrize(
    "scheme, options, needle",
    [
        (
            "fastrpb",
            {"mode_2d": "full"},
            "mode_2d='full' would be ignored: it acts on a 2D grid "
            "only (this layer: 1D, no grid). Drop it or leave it at 'axial'.",
        ),
        ("fastrpb", {"shared_axes": True}, "shared_axes=True would be ignored"),
        (
            "spe",
            {"kind": "conv", "num_sines": 4},
            "num_sines=4 would be ignored: it acts with " "kind='sine' only",
        ),
        ("spe", {"kernel_size": 4}, "kernel_size=4 would be ignored: it acts with kind='conv'"),
    ],
)
def test_an_option_the_setting_ignores_is_refused(scheme, options, needle):
  with pytest.raises(ValueError, match="would be ignored") as e:
    _cfg((scheme, options))
  assert needle in str(e.value)
  assert positional.get_class(scheme).unused_options(options, two_d=False) == [
      k for k in options if k not in ("kind",)
  ]


def test_2d_options_and_schemes_on_1d_input():
  _cfg(("fastrpb", {"mode_2d": "full", "shared_axes": False}), grid=(3, 4))  # 2D: used
  with pytest.raises(ValueError, match="'spe' has no 2D form"):
    _cfg("spe", grid=(3, 4))
  # A layer built for a grid called without one (and the reverse) raises before compute.
  layer = Attention(_cfg("fastrpb", grid=(3, 4)))
  x = jnp.ones((1, N, W))
  with pytest.raises(ValueError, match=r"built with grid=\(3, 4\) but called with grid=None"):
    layer.init(jax.random.key(0), x)
  scheme = positional.build(
      "absolute", positional.Dims(HEADS, W // HEADS, W // HEADS, W, N, grid=(3, 4))
  )
  ctx = positional.Context(length=N)
  with pytest.raises(
      ValueError, match=r"absolute: built for grid \(3, 4\) but called with grid " r"None"
  ):
    scheme.init(jax.random.key(0), x, ctx, method=lambda m, x, c: m.embed(x, c))


def test_share_across_layers_needs_the_shared_module():
  cfg = _cfg(("t5_bias", {"share_across_layers": True}))
  with pytest.raises(
      ValueError,
      match="'t5_bias' has share_across_layers=True but Attention got " "no shared module",
  ):
    Attention(cfg)
  with pytest.raises(
      ValueError,
      match="a shared module for positional scheme 't5_bias', which "
      "the config does not use; its schemes: none",
  ):
    Attention(_cfg(), shared=(positional.build("t5_bias", cfg.scheme_dims()["t5_bias"]),))
  # Inside a Tower the layers share one table.
  tower = Tower(cfg, num_layers=2, mlp_dim=W)
  params = jax.eval_shape(tower.init, jax.random.key(0), jnp.ones((1, N, W)), None)["params"]
  assert "pos_t5_bias_shared" in params and "pos_t5_bias" not in params["block_0"]["attention"]


@pytest.mark.parametrize(
    "build, needle",
    [
        (lambda: _cfg(embed_dim=0), "AttentionConfig: embed_dim must be an int >= 1; got 0."),
        (
            lambda: _cfg(chunk_size=0),
            "chunk_size must be None (chosen by shape) or an int >= 1; " "got 0.",
        ),
        (
            lambda: _cfg(grid=(3, 0)),
            "grid must be None (1D) or a tuple (H, W) of ints >= 1; got " "(3, 0).",
        ),
        (lambda: Block(_cfg(), mlp_dim=0), "Block: mlp_dim must be an int >= 1; got 0."),
        (
            lambda: Block(_cfg(), mlp_dim=W, dropout_rate=1.5),
            "Block: dropout_rate must be a number " "in [0, 1); got 1.5.",
        ),
        (
            lambda: Block(_cfg(), mlp_dim=W, norm="rms"),
            "Block: unknown norm 'rms'; valid choices: " "post, pre, batch.",
        ),
        (
            lambda: Tower(_cfg(), num_layers=0, mlp_dim=W),
            "Tower: num_layers must be an int >= 1; " "got 0.",
        ),
        (
            lambda: Classifier(_cfg(), VOCAB, 1, W, pooling="max", num_classes=3),
            "Classifier: unknown pooling 'max'; valid choices: mean, cls.",
        ),
        (
            lambda: Classifier(_cfg(), VOCAB, 1, W),
            "Classifier: num_classes must be an int >= 2; " "got 0.",
        ),
        (
            lambda: DualEncoder(_cfg(), 0, 1, W, num_classes=2),
            "DualEncoder: vocab_size must be an " "int >= 1; got 0.",
        ),
        (
            lambda: Classifier(_cfg(grid=(3, 4)), VOCAB, 1, W, pooling="cls", num_classes=3),
            "pooling='cls' prepends a token, which breaks the image grid (3, 4)",
        ),
        (
            lambda: DecoderLM(_cfg(causal=True), VOCAB, 1, W, pooling="cls"),
            "DecoderLM: pooling and num_classes are encoder fields",
        ),
        (
            lambda: DecoderLM(_cfg(causal=True), VOCAB, 1, W, memory_length=-1),
            "DecoderLM: memory_length must be an int >= 0 (0: no memory); got -1.",
        ),
    ],
)
def test_values_out_of_range_are_refused_at_construction(build, needle):
  with pytest.raises(ValueError) as e:
    build()
  assert needle in str(e.value)


def test_inputs_a_call_would_ignore_are_refused():
  block = Block(_cfg(), mlp_dim=W)
  x = jnp.ones((1, N, W))
  params = jax.eval_shape(block.init, jax.random.key(0), x)  # each call raises before compute
  with pytest.raises(ValueError, match="memory_mask given without memory"):
    block.apply(params, x, memory_mask=jnp.ones((1, 3), bool))
  lm = DecoderLM(_cfg(causal=True), VOCAB, 1, W)
  batch = {"inputs": jnp.ones((1, N), jnp.int32)}
  variables = jax.eval_shape(lm.init, jax.random.key(0), batch)
  with pytest.raises(ValueError, match="cache_length=8 is for decode=True only"):
    lm.apply(variables, batch, cache_length=8)
  with pytest.raises(ValueError, match="decode=True reads the cache; memory is not used"):
    lm.apply(variables, batch, decode=True, memory=lm.init_memory(1))
  tower = Tower(_cfg(causal=True), num_layers=2, mlp_dim=W)
  with pytest.raises(ValueError, match=r"memory holds 1 states; one per layer \(2\)"):
    tower.init(jax.random.key(0), x, None, memory=([jnp.zeros((1, 3, W))], jnp.ones((1, 3), bool)))
  with pytest.raises(ValueError, match="a decoding step reads the cache, not memory"):
    tower.init(
        jax.random.key(0),
        x,
        None,
        decode=decoding.Step(offset=0, cache_length=N),
        memory=([jnp.zeros((1, 3, W))] * 2, jnp.ones((1, 3), bool)),
    )


def test_a_bidirectional_lm_is_refused():
  with pytest.raises(ValueError) as e:
    DecoderLM(_cfg(), VOCAB, 1, W)
  assert str(e.value).startswith(
      "DecoderLM: the attention config is bidirectional " "(causal=False)"
  )
  assert "AttentionConfig(..., causal=True)" in str(e.value)


@pytest.mark.parametrize(
    "kernel, schemes",
    [
        # Slow; the default run keeps the linear LM with both FFT hooks (elu1 below).
        pytest.param("softmax", ("absolute", "fastrpb", "t5_bias"), marks=pytest.mark.slow),
        ("elu1", ("fastrpb", "kernelized_rpe")),
    ],
)
def test_the_lm_never_sees_a_later_token(kernel, schemes):
  lm = DecoderLM(
      _cfg(*schemes, kernel=kernel, causal=True, chunk_size=4),
      VOCAB,
      num_layers=1,
      mlp_dim=W,
      dtype=jnp.float64,
  )
  ids = jax.random.randint(jax.random.key(0), (2, N), 1, VOCAB)
  params = jax.jit(lm.init)(jax.random.key(1), {"inputs": ids})["params"]
  # Tables start at zero: randomise every parameter so that every scheme acts.
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  params = jax.tree.unflatten(
      tree, [p + 0.3 * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys)]
  )
  logits = jax.jit(lambda i: lm.apply({"params": params}, {"inputs": i}))
  base = np.asarray(logits(ids))
  worst = 0.0
  for t in (3, 7, N - 1):
    changed = ids.at[:, t].set(ids[:, t] % (VOCAB - 1) + 1)
    out = np.asarray(logits(changed))
    worst = max(worst, float(np.max(np.abs(out[:, :t] - base[:, :t]))))
    assert np.max(np.abs(out[:, t] - base[:, t])) > 1e-3  # the token itself matters
  assert worst < 1e-12, worst
