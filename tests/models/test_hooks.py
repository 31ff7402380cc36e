"""The hook dispatcher (``fastpos.models.hooks``): the one place the positional hooks run, in
one order, for the full forward and for decoding alike.

* No other module of the attention layer calls a hook, and decoding reads only the layer's
  public state (its config and Flax's variable API), never its private methods.
* Both the full forward (``FullPath``) and decoding steps (``StepPath``) go through
  ``hooks.run``, and a layer decoded block by block equals its full causal forward (float64).
"""

from __future__ import annotations

import ast
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.models import attention, decoding, hooks
from fastpos.models.attention import Attention, AttentionConfig, KernelSpec, PositionalSpec

HOOK_NAMES = ("embed", "features", "logits", "kv", "output")
# What decoding may read of the layer: its config and Flax's variable API.
LAYER_API = {"cfg", "variable", "has_variable", "is_initializing", "scope"}


def _tree(module):
  return ast.parse(inspect.getsource(module))


def _hook_calls(module) -> list[str]:
  """The hook names a module calls as methods (``x.features(...)``, ...)."""
  return sorted(
      {
          node.func.attr
          for node in ast.walk(_tree(module))
          if isinstance(node, ast.Call)
          and isinstance(node.func, ast.Attribute)
          and node.func.attr in HOOK_NAMES
      }
  )


def test_only_the_dispatcher_calls_the_hooks():
  assert _hook_calls(attention) == []
  assert _hook_calls(decoding) == []
  assert _hook_calls(hooks) == ["features", "kv", "logits", "output"]


def test_decoding_reads_only_the_layers_public_state():
  tree = _tree(decoding)
  used = {
      node.attr
      for node in ast.walk(tree)
      if isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and node.value.id == "layer"
  }
  assert used and used <= LAYER_API, used
  imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
  assert "attention" not in imported  # decoding does not reach back into the layer's module


CELLS = [
    # recurrent state, a sign-changing post_phi scheme, an output hook
    ("elu1", ("lrpe", "fastrpb")),
    # key / value cache, a logits hook (test_decoding's default cells decode it in a model)
    pytest.param("softmax", ("t5_bias",), marks=pytest.mark.slow),
]
B, N, D, H, BLOCK = 2, 8, 8, 2, 4


def _layer(kernel, schemes):
  cfg = AttentionConfig(
      num_heads=H,
      head_dim=D // H,
      embed_dim=D,
      kernel=KernelSpec(kernel),
      positional=tuple(PositionalSpec.make(s, {}) for s in schemes),
      max_length=N,
      causal=True,
  )
  return Attention(cfg, dtype=jnp.float64)


def _params(layer, x, mask):
  params = jax.jit(lambda: layer.init(jax.random.key(0), x, mask=mask)["params"])()
  leaves, tree = jax.tree.flatten(params)  # random tables (they start at zero)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  return jax.tree.unflatten(
      tree,
      [a + 0.3 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys, strict=True)],
  )


@pytest.mark.parametrize("kernel,schemes", CELLS, ids=["elu1-lrpe+fastrpb", "softmax-t5_bias"])
def test_forward_and_decoding_share_the_dispatcher(kernel, schemes, monkeypatch):
  paths = []
  real = hooks.run

  def spy(hooks_, path, *args, **kwargs):
    paths.append(type(path).__name__)
    return real(hooks_, path, *args, **kwargs)

  monkeypatch.setattr(hooks, "run", spy)
  layer = _layer(kernel, schemes)
  x = jax.random.normal(jax.random.key(1), (B, N, D), jnp.float64)
  mask = jnp.ones((B, N), bool).at[1, :2].set(False)  # a left-padded row
  params = _params(layer, x, mask)
  full = jax.jit(lambda p: layer.apply({"params": p}, x, mask=mask))(params)
  assert paths == ["FullPath", "FullPath"]  # init and apply

  @jax.jit
  def step(cache, xs, ms, start):
    out, upd = layer.apply(
        {"params": params, "cache": cache},
        xs,
        mask=ms,
        decode=decoding.Step(start),
        mutable=["cache"],
    )
    return out, upd["cache"]

  init = decoding.Step(jnp.int32(0), cache_length=N)
  shapes = jax.eval_shape(lambda: layer.init(jax.random.key(0), x[:, :1], decode=init)["cache"])
  cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)  # an empty state
  outs = []
  for start in range(0, N, BLOCK):  # one compiled step, called on two blocks
    out, cache = step(cache, x[:, start : start + BLOCK], mask[:, start : start + BLOCK], start)
    outs.append(out)
  assert paths[2:] == ["StepPath"] * 2  # the cache's shapes, then the step's one trace
  dec = np.asarray(jnp.concatenate(outs, axis=1))
  m = np.asarray(mask)[..., None]
  err = np.max(np.abs(dec - np.asarray(full)) * m) / np.max(np.abs(np.asarray(full)) * m)
  assert err < 1e-9, err
