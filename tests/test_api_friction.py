"""What a researcher trips over first, each answered: one example ``[N, D]`` runs (a batch axis
of one, so a per-example ``vmap`` works); other ranks, N = 0 and a width other than
``embed_dim`` are named in one line; the models take bare token ids; ``Attention``, ``Block``,
``Tower`` and the models share one call convention (``mask=``); the layer keywords go through
the config schema and a typo is an unknown keyword with a suggestion; ``generate`` says it runs
outside jit; ``configs/text_lm.py`` ships no text and says which field to set; a run records
its data paths absolute."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastpos
from fastpos import config_schema
from fastpos.tasks import text_lm
from fastpos.train import cli
from fastpos.train.trainer import absolute_paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W, H, N, VOCAB = 16, 2, 6, 20
SHAPE_WORDS = r"x must be \[batch, length, embed_dim\] \(or \[length, embed_dim\] for one example\)"


def _cfg(**kw):
  kw = dict(kernel="elu1", positional="rope", causal=True, max_length=16) | kw
  return fastpos.attention_config(W, H, **kw)


def _layers():
  """(name, module) of the three layer-level modules, each on [b, N, W] float inputs."""
  cfg = _cfg()
  return [
      ("Attention", fastpos.Attention(cfg)),
      ("Block", fastpos.Block(cfg, mlp_dim=W)),
      ("Tower", fastpos.Tower(cfg, num_layers=1, mlp_dim=W)),
  ]


@pytest.fixture(scope="module")
def layers():
  x = jax.random.normal(jax.random.key(0), (2, N, W))
  return x, [(name, m, jax.jit(m.init)(jax.random.key(1), x)) for name, m in _layers()]


# Slow; the default run keeps the layer's examples (tests/test_api_docs.py) and unbatched masks
# (test_an_unbatched_mask_must_match_the_unbatched_input).
@pytest.mark.slow
def test_one_example_runs_with_a_batch_axis_of_one_and_under_vmap(layers):
  x, built = layers
  mask = jnp.arange(N)[None, :] < jnp.array([[N], [4]])
  for name, module, variables in built:
    apply = jax.jit(module.apply)  # one compile per shape, not one per operation
    full = apply(variables, x, mask=mask)
    assert full.shape == (2, N, W), name
    one = apply(variables, x[1], mask=mask[1])  # [N, W] with mask [N]
    assert one.shape == (N, W), name
    np.testing.assert_allclose(one, full[1], rtol=1e-6, atol=1e-6, err_msg=name)
    mapped = jax.jit(jax.vmap(lambda a, m, v=variables, f=apply: f(v, a, mask=m)))(x, mask)
    np.testing.assert_allclose(mapped, full, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    "shape, dtype, needle",
    [
        ((N,), jnp.float32, rf"{SHAPE_WORDS}, embed_dim={W}; got shape \({N},\) \(rank 1\)"),
        ((1, 2, N, W), jnp.float32, rf"{SHAPE_WORDS}, embed_dim={W}; got shape \(1, 2, {N}, {W}\)"),
        ((2, 0, W), jnp.float32, rf"x holds no token \(length 0\); {SHAPE_WORDS}"),
        ((2, N, 8), jnp.float32, rf"x's last axis is 8, but the layer was built for embed_dim={W}"),
        ((2, N, W), jnp.int32, "x must be floating embeddings .* got int32 .*token ids go through"),
    ],
)
def test_shape_mistakes_are_named_in_one_line(layers, shape, dtype, needle):
  _, built = layers
  for name, module, variables in built:
    with pytest.raises(ValueError, match=rf"^{name}: {needle}") as e:
      module.apply(variables, jnp.ones(shape, dtype))
    assert "\n" not in str(e.value)


def test_an_unbatched_mask_must_match_the_unbatched_input(layers):
  x, built = layers
  name, module, variables = built[0]
  with pytest.raises(ValueError, match=r"mask must be \[length\]=\(6,\) .*got shape \(1, 6\)"):
    module.apply(variables, x[0], mask=jnp.ones((1, N), bool))
  tower, tv = built[2][1], built[2][2]
  memory = ([jnp.zeros((3, W))], jnp.ones((3,), bool))
  with pytest.raises(ValueError, match=r"^Tower: memory needs a batched x"):
    tower.apply(tv, x[0], memory=memory)


# Slow; the default run keeps the towers' examples (tests/test_api_docs.py) and their bad inputs
# (test_bad_model_inputs_say_what_to_pass).
@pytest.mark.slow
def test_tower_takes_mask_by_keyword_and_returns_an_array(layers):
  x, built = layers
  _, tower, variables = built[2]
  mask = jnp.ones((2, N), bool).at[1, 4:].set(False)
  states = tower.apply(variables, x, mask=mask)
  assert isinstance(states, jax.Array) and states.shape == (2, N, W)
  np.testing.assert_array_equal(tower.apply(variables, x, mask), states)  # older code: by position
  # With memory (Transformer-XL, softmax): (states, new memory).
  txl = fastpos.Tower(_cfg(kernel="softmax", positional=()), num_layers=1, mlp_dim=W)
  memory = ([jnp.zeros((2, 3, W))], jnp.ones((2, 3), bool))
  out, (new_states, new_mask) = txl.apply(
      txl.init(jax.random.key(0), x, memory=memory), x, mask=mask, memory=memory
  )
  assert out.shape == (2, N, W) and new_states[0].shape == (2, 3, W)
  np.testing.assert_array_equal(new_mask, mask[:, -3:])


@pytest.fixture(scope="module")
def lm():
  model = fastpos.DecoderLM(_cfg(), vocab_size=VOCAB, num_layers=1, mlp_dim=W)
  ids = jax.random.randint(jax.random.key(2), (2, N), 1, VOCAB).at[0, :2].set(0)
  return model, jax.jit(model.init)(jax.random.key(0), ids), ids


# Slow; the default run keeps the models' examples (tests/test_api_docs.py) and their bad inputs
# (test_bad_model_inputs_say_what_to_pass).
@pytest.mark.slow
def test_models_take_bare_token_ids(lm):
  model, variables, ids = lm
  apply = jax.jit(model.apply)  # one compile per call form, not one per operation
  from_dict = apply(variables, {"inputs": ids, "mask": ids != 0})
  assert from_dict.shape == (2, N, VOCAB)
  np.testing.assert_array_equal(apply(variables, ids), from_dict)  # mask: ids != 0
  np.testing.assert_array_equal(apply(variables, ids, mask=ids != 0), from_dict)
  clf = fastpos.Classifier(
      _cfg(causal=False), vocab_size=VOCAB, num_layers=1, mlp_dim=W, num_classes=2
  )
  cv = jax.jit(clf.init)(jax.random.key(0), ids)
  clf_apply = jax.jit(clf.apply)
  np.testing.assert_array_equal(clf_apply(cv, ids), clf_apply(cv, {"inputs": ids}))


@pytest.mark.parametrize(
    "args, keywords, needle",
    [
        ((jnp.ones((2, N)),), {}, r"got float(32|64) of shape \(2, 6\)"),
        ((jnp.ones((N,), jnp.int32),), {}, r"got int32 of shape \(6,\)"),
        ((jnp.ones((2, 0), jnp.int32),), {}, r"got int32 of shape \(2, 0\)"),
        (({"ids": jnp.ones((2, N), jnp.int32)},), {}, r"got a dict with keys \['ids'\]"),
    ],
)
def test_bad_model_inputs_say_what_to_pass(lm, args, keywords, needle):
  model, variables, _ = lm
  with pytest.raises(
      ValueError, match=r"^DecoderLM takes token ids int \[batch, length\] .*" + needle
  ):
    model.apply(variables, *args, **keywords)


def test_a_mask_given_twice_and_a_dual_encoder_without_its_dict_are_refused(lm):
  model, variables, ids = lm
  with pytest.raises(ValueError, match="^DecoderLM: mask= given beside a batch dict"):
    model.apply(variables, {"inputs": ids}, mask=ids != 0)
  dual = fastpos.DualEncoder(
      _cfg(causal=False), vocab_size=VOCAB, num_layers=1, mlp_dim=W, num_classes=2
  )
  with pytest.raises(ValueError, match="^DualEncoder takes a batch dict with both documents"):
    dual.init(jax.random.key(0), ids)


@pytest.mark.parametrize("eps", [float("nan"), -1, 0, True, float("inf")])
def test_kernel_options_go_through_the_config_schema(eps):
  decl = config_schema.kernel_options()["eps"]
  assert not decl.is_valid(eps)  # train.py refuses it: the same declaration
  want = f"fastpos.attention: eps must be {decl.describe()}; got {eps!r}."
  with pytest.raises(ValueError) as e:
    fastpos.attention(W, H, kernel="elu1", eps=eps)
  assert str(e.value) == want
  with pytest.raises(ValueError, match="^fastpos.attention_config: eps must be a finite number"):
    fastpos.attention_config(W, H, kernel="elu1", eps=eps)


@pytest.mark.parametrize(
    "keywords, needle",
    [
        (dict(max_length=0), "max_length must be an integer >= 1; got 0"),
        (dict(num_features=0, kernel="favor"), "num_features must be an integer >= 1; got 0"),
        (dict(causal=1), "causal must be true or false; got 1"),
        (dict(kernel="elu"), "kernel must be one of softmax, elu1, relu"),
        (dict(chunk_size=-2), "chunk_size must be an integer >= 0; got -2"),
        (dict(seed=-1, kernel="favor"), "seed must be an integer >= 0 and <= 4294967295"),
    ],
)
def test_errors_name_the_keyword_the_caller_passed(keywords, needle):
  with pytest.raises(ValueError, match=f"^fastpos.attention: {needle}") as e:
    fastpos.attention(W, H, **keywords)
  assert "config." not in str(e.value) and "model." not in str(e.value)


@pytest.mark.parametrize(
    "fn, keywords, needle",
    [
        ("attention", dict(kernal="elu1"), "unknown keyword kernal='elu1'. Did you mean kernel=?"),
        (
            "attention_config",
            dict(causall=True),
            "unknown keyword causall=True. Did you mean causal=?",
        ),
        (
            "attention",
            dict(fastrbp={"per_head": True}),
            "unknown keyword fastrbp={'per_head': True}. Did you mean fastrpb=?",
        ),
    ],
)
def test_typos_are_unknown_keywords_with_a_suggestion(fn, keywords, needle):
  with pytest.raises(TypeError) as e:
    getattr(fastpos, fn)(W, H, **keywords)
  text = str(e.value)
  assert text.startswith(f"fastpos.{fn}: {needle}"), text
  assert "Valid keywords: embed_dim, num_heads, kernel, positional, causal, max_length" in text
  assert ("dtype, name" in text) == (fn == "attention")
  assert "<scheme>={option: value}" in text and "fastrpb" in text


def test_generate_says_it_runs_outside_jit(lm):
  model, variables, ids = lm
  with pytest.raises(ValueError, match=r"^generate runs outside jax.jit .* traced here: params"):
    jax.jit(lambda p: fastpos.generate(model, p, ids[1:], 2))(variables["params"])
  assert fastpos.generate(model, variables["params"], ids[1:], 2).shape == (1, 2)


def test_text_lm_ships_no_text_and_names_the_field():
  full = cli.load_config(os.path.join(ROOT, "configs", "text_lm.py"))
  assert full.task.paths == ""
  with pytest.raises(
      ValueError, match=r"^text_lm: config.task.paths is empty.*--config.task.paths="
  ):
    text_lm.text_files(full.task.paths, full.task.include)
  vim = cli.load_config(os.path.join(ROOT, "configs", "text_lm.py:vim"))
  assert (vim.task.paths, vim.task.include) == ("/usr/share/vim/vim90/doc", "usr_*.txt")
  mine = cli.load_config(os.path.join(ROOT, "configs", "text_lm.py:paths=notes"))
  assert (mine.task.paths, mine.task.include) == ("notes", "*.txt")


def test_relative_data_paths_are_recorded_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  cfg = cli.load_config(os.path.join(ROOT, "configs", "text_lm.py:tiny"))
  cfg.task.paths = "books/a.txt, notes"
  cfg.task.cache_dir = "~/cache_here"
  out = absolute_paths(cfg)
  assert out.task.paths == f"{tmp_path}/books/a.txt,{tmp_path}/notes"
  assert out.task.cache_dir == os.path.expanduser("~/cache_here")
  assert cfg.task.paths == "books/a.txt, notes"  # the caller's config is left as it was
  untouched = cli.load_config(os.path.join(ROOT, "configs", "text_lm.py:tiny"))
  assert absolute_paths(untouched) is untouched  # absolute already: no copy
