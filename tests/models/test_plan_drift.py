"""The plan cannot drift from the code: for kernel x scheme x setting cells, the verdict of
``fastpos.positional.compatibility.plan`` equals what happens when the attention layer is built
and traced on a tiny input (``jax.eval_shape``: every refusal is at configuration or trace
time, before any compute), a refusal is the plan's own message, and the facts the plan
predicts for the linear path (kv terms, the keys' running maximum) are those the layer meets.

The default run takes every scheme in every setting with one kernel (the kernels rotate over
the cells); ``-m slow`` runs the full product. A split sequence needs
several devices: tests/models/test_context_parallel.py runs it.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos import positional
from fastpos.models import attention as attention_lib
from fastpos.models.attention import Attention, AttentionConfig, KernelSpec, PositionalSpec
from fastpos.models.decoding import Step
from fastpos.ops import segments
from fastpos.positional import compatibility
from fastpos.positional.compatibility import Setting

N, D, H, GRID = 16, 8, 2, (4, 4)  # N = 16: the fused kernel's smallest block
# Linear kernels with different facts: elementwise (elu1), stabilised with scaled keys (sikf),
# random features (favor), signed features (trf), reading other keys (prf: none, nu: dpfp).
LINEAR = ("elu1", "sikf", "favor", "trf", "dpfp")
SETTINGS = {
    "bidirectional 1D": Setting(),
    "causal 1D": Setting(causal=True),
    "bidirectional 2D": Setting(two_d=True),
    "causal 2D": Setting(causal=True, two_d=True),
    "chunks": Setting(attn_chunk=2),
    "causal chunks": Setting(causal=True, attn_chunk=2),
    "packed": Setting(packed=True),
    "causal packed": Setting(causal=True, packed=True),
    "causal memory": Setting(causal=True, memory=True),
    "decoding": Setting(causal=True, decoding=True),
    "fused": Setting(causal=True, mode="fused"),
    "fused packed": Setting(causal=True, mode="fused", packed=True),
    "fused 2D": Setting(causal=True, two_d=True, mode="fused"),
}
# Scheme variants beside the defaults: a causal decay (the kv hook's decay), the paper's axial
# 2D bias (not causal), a scheme pair.
SCHEMES = [((s,), ({},)) for s in positional.SCHEMES if s != "none"] + [
    ((), ()),
    (("permuteformer",), ({"decay": 0.9},)),
    (("fastrpb",), ({"mode_2d": "axial"},)),
    (("rope", "fastrpb"), ({}, {})),
]


def _id(cell):
  kernel, schemes, opts, name = cell
  extra = "".join(f"{k}={v}" for o in opts for k, v in o.items())
  return f"{kernel}-{'+'.join(schemes) or 'none'}{'-' + extra if extra else ''}-{name}"


def _cells(full: bool):
  kernels = ("softmax",) + LINEAR
  for i, ((schemes, opts), name) in enumerate(itertools.product(SCHEMES, SETTINGS)):
    for kernel in kernels if full else (kernels[i % len(kernels)],):
      yield kernel, schemes, opts, name


SAMPLE = list(_cells(full=False))
REST = [c for c in _cells(full=True) if c not in SAMPLE]


def _layer(kernel, schemes, opts, s: Setting):
  cfg = AttentionConfig(
      num_heads=H,
      head_dim=D // H,
      embed_dim=D,
      kernel=KernelSpec(kernel),
      positional=tuple(PositionalSpec.make(n, o) for n, o in zip(schemes, opts)),
      max_length=N + 2,  # + the memory's 2 keys
      grid=GRID if s.two_d else None,
      causal=s.causal,
      attn_chunk=s.attn_chunk,
      mode=s.mode,
  )
  return Attention(cfg.attention_only(), dtype=jnp.float32)


def _trace(kernel, schemes, opts, s: Setting, seen: list) -> None:
  """Builds the layer and traces init and apply in setting ``s``; raises what the layer
  raises. ``seen`` collects each whole-sequence path's (plan, runtime facts)."""
  layer = _layer(kernel, schemes, opts, s)
  x = jax.ShapeDtypeStruct((1, N, D), jnp.float32)
  kw = {}
  if s.two_d:
    kw["grid"] = GRID
  if s.memory:
    kw["memory"] = jnp.zeros((1, 2, D))
  if s.decoding:
    kw["decode"] = Step(jnp.int32(0), cache_length=N)
  ids = np.repeat(np.array([[1, 2]], np.int32), N // 2, axis=1)
  positions = np.tile(np.arange(N // 2, dtype=np.int32), 2)[None]
  with segments.packed(ids if s.packed else None, positions):
    key = jax.random.key(0)
    variables = jax.eval_shape(lambda x: layer.init(key, x, **kw), x)
    if s.decoding:  # the cache exists now: a step reads it
      kw["decode"] = Step(jnp.int32(0))
      jax.eval_shape(lambda v, x: layer.apply(v, x, mutable=["cache"], **kw), variables, x)
    else:
      jax.eval_shape(lambda v, x: layer.apply(v, x, **kw), variables, x)


@pytest.fixture
def seen(monkeypatch):
  """The whole-sequence paths the layer built: (plan, the facts the layer met at run time)."""
  paths = []
  init = attention_lib.FullPath.__init__

  def spy(self, plan, cfg, hooks, *args, **kwargs):
    init(self, plan, cfg, hooks, *args, **kwargs)
    mix, post = self.mix, hooks.post_phi
    met = dict(
        kv=tuple(
            t
            for t, a in (("table", mix.log_table), ("decay", mix.log_decay))
            if a is not None and plan.path == "linear"
        ),
        # The running maximum's rule as the layer wrote it before the plan existed.
        key_scales=(
            cfg.causal
            and cfg.kernel.scaled_keys
            and mix.log_table is None
            and mix.log_decay is None
            and all(s.permutes_features for s in post)
            and not self.split
            and not self.reference
        ),
        den_features=plan.path == "linear" and any(not s.keeps_nonnegative for s in post),
    )
    if plan.runs == "whole":  # a chunked layer's path only adds its output terms
      paths.append((plan, met))

  monkeypatch.setattr(attention_lib.FullPath, "__init__", spy)
  return paths


def _check(cell, seen):
  kernel, schemes, opts, name = cell
  s = SETTINGS[name]
  # The layer runs the schemes but embedding ones (the model's Tower runs those).
  kept = [(n, o) for n, o in zip(schemes, opts) if positional.get_class(n).hooks != ("embed",)]
  schemes, opts = tuple(n for n, _ in kept), tuple(o for _, o in kept)
  try:
    plan = compatibility.plan(kernel, schemes, s, options=dict(zip(schemes, opts)))
    why = None
  except ValueError as e:
    plan, why = None, str(e)
  try:
    _trace(kernel, schemes, opts, s, seen)
  except ValueError as e:
    assert why is not None, f"the plan runs {cell}, the layer refuses: {e}"
    assert why in str(e), (why, str(e))
    return
  assert why is None, f"the plan refuses {cell} ({why}), the layer runs it"
  for planned, met in seen:
    got = dict(kv=planned.kv, key_scales=planned.key_scales, den_features=planned.den_features)
    assert got == met, (cell, got, met)
  assert plan.runs in ("whole", "chunks", "decoding")


@pytest.mark.parametrize("cell", SAMPLE, ids=_id)
def test_plan_verdict_equals_the_layer(cell, seen):
  _check(cell, seen)


@pytest.mark.slow
@pytest.mark.parametrize("cell", REST, ids=_id)
def test_plan_verdict_equals_the_layer_every_kernel(cell, seen):
  _check(cell, seen)


def test_the_sample_covers_every_scheme_setting_and_kernel():
  assert {(c[1], repr(c[2]), c[3]) for c in SAMPLE} == {
      (sch, repr(o), n) for (sch, o), n in itertools.product(SCHEMES, SETTINGS)
  }
  assert {c[0] for c in SAMPLE} == {"softmax", *LINEAR}
  verdicts = {
      compatibility.refusal(c[0], c[1], SETTINGS[c[3]], options=dict(zip(c[1], c[2]))) is None
      for c in SAMPLE
  }
  assert verdicts == {True, False}  # the sample holds cells that run and cells refused
