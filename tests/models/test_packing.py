"""Packed rows (segment ids + in-segment positions): each sequence's outputs are those it has
alone, for the cells that pack; the others refuse with a message."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.models import AttentionConfig, TaskInfo, build_model, model_config
from fastpos.models.attention import Attention
from fastpos.ops import segments
from fastpos.positional import compatibility
from tests.helpers import rel_err

V, N = 13, 16
LENGTHS = (5, 7, 3)  # packed into one row of 16: 15 real tokens, 1 padding slot


def _cfg(kernel, scheme):
  c = model_config()
  c.num_layers, c.embed_dim, c.num_heads, c.mlp_dim, c.dropout_rate = 1, 16, 2, 16, 0.0
  c.kernel, c.positional, c.dtype = kernel, scheme, "float64"
  c.kernel_options.num_features = 8
  return c


def _sequences(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, V, n).astype(np.int32) for n in LENGTHS]


def _packed_row(seqs):
  inputs, ids, pos = (np.zeros((1, N), np.int32) for _ in range(3))
  at = 0
  for s, seq in enumerate(seqs, 1):
    inputs[0, at : at + len(seq)] = seq
    ids[0, at : at + len(seq)] = s
    pos[0, at : at + len(seq)] = np.arange(len(seq))
    at += len(seq)
  return {"inputs": inputs, "mask": inputs != 0, "segment_ids": ids, "positions": pos}


def _alone(seq):
  inputs = np.zeros((1, N), np.int32)
  inputs[0, : len(seq)] = seq
  return {"inputs": inputs, "mask": inputs != 0}


def _random_params(model, batch):
  """The init (one compiled program) plus noise drawn by NumPy (no program per leaf shape)."""
  variables = jax.jit(model.init)(jax.random.key(0), batch)
  leaves, tree = jax.tree.flatten(variables)
  rng = np.random.default_rng(1)
  return jax.tree.unflatten(
      tree,
      [(np.asarray(x) + 0.2 * rng.standard_normal(x.shape)).astype(x.dtype) for x in leaves],
  )


@pytest.mark.parametrize(
    "scheme, layers",
    [
        ("absolute+t5_bias", {}),
        # The segments reach the layers through nn.scan and remat, too. Slow; the default run
        # keeps the one-layer row (above) and scan + remat (tests/models/test_remat.py).
        pytest.param(
            "absolute+t5_bias",
            dict(num_layers=2, scan_layers=True, remat="block"),
            marks=pytest.mark.slow,
        ),
        pytest.param("rope", {}, marks=pytest.mark.slow),
        pytest.param("absolute", {}, marks=pytest.mark.slow),
        pytest.param("absolute+kernelized_rpe", {}, marks=pytest.mark.slow),
    ],
)
def test_packed_row_equals_each_sequence_alone(scheme, layers):
  cfg = _cfg("softmax", scheme)
  cfg.update(layers)
  model = build_model(cfg, TaskInfo("lm", V, 0, N))
  seqs = _sequences()
  row = _packed_row(seqs)
  variables = _random_params(model, _alone(seqs[0]))
  apply = jax.jit(model.apply)
  packed = np.asarray(apply(variables, row))[0]
  at, worst = 0, 0.0
  for seq in seqs:
    alone = np.asarray(apply(variables, _alone(seq)))[0, : len(seq)]
    worst = max(worst, rel_err(packed[at : at + len(seq)], alone))
    at += len(seq)
  print(f"{scheme}: worst relative error, packed vs alone: {worst:.2e}")
  assert worst < 1e-9, worst
  unpacked = np.asarray(apply(variables, {k: row[k] for k in ("inputs", "mask")}))[0]
  assert rel_err(unpacked[LENGTHS[0] :], packed[LENGTHS[0] :]) > 1e-3  # the segments matter


@pytest.mark.parametrize(
    "kernel, scheme, match",
    [
        (
            "elu1",
            "kernelized_rpe",
            r"kernel 'elu1', schemes kernelized_rpe\): scheme 'kernelized_rpe': with a "
            "linear kernel its exp",
        ),
        ("softmax", "absolute+fastrpb", "scheme 'fastrpb': its W V is one Toeplitz product"),
        ("softmax", "permuteformer", "scheme 'permuteformer': not checked for packing"),
    ],
)
def test_cells_that_cannot_pack_refuse(kernel, scheme, match):
  model = build_model(_cfg(kernel, scheme), TaskInfo("lm", V, 0, N))
  row = _packed_row(_sequences())
  # Shapes only: the refusal comes while the call is traced, before any compute.
  variables = jax.eval_shape(model.init, jax.random.key(0), _alone(_sequences()[0]))
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(model.apply, variables, row)


def test_refusal_table():
  packed = lambda **kw: compatibility.Setting(packed=True, **kw)
  assert compatibility.refusal("softmax", ["absolute", "rope"], packed(causal=True)) is None
  assert compatibility.refusal("sikf", [], packed()) is None
  assert "Toeplitz" in compatibility.refusal("sikf", ["fastrpb"], packed())
  assert "grid" in compatibility.refusal("softmax", [], packed(two_d=True))
  assert "memory" in compatibility.refusal("softmax", [], packed(causal=True, memory=True))
  with (
      pytest.raises(ValueError, match="needs 'positions'"),
      segments.packed(np.ones((1, 4), np.int32), None),
  ):
    pass


def test_bidirectional_layer_keeps_segments_apart():
  """The attention layer itself, bidirectional softmax + T5 bias, float64: a packed row's
  outputs equal each segment run alone (padded)."""
  layer = Attention(
      AttentionConfig.from_model_config(_cfg("softmax", "t5_bias"), TaskInfo("classify", V, 3, N)),
      dtype=jnp.float64,
  )
  x = np.random.default_rng(0).normal(size=(1, N, 16))
  row = _packed_row(_sequences())
  variables = _random_params(layer, x)
  with segments.packed(row["segment_ids"], row["positions"]):  # read while traced
    packed = np.asarray(jax.jit(layer.apply)(variables, x, mask=row["mask"]))[0]
  apply = jax.jit(layer.apply)  # one program for every segment alone
  at, worst = 0, 0.0
  for n in LENGTHS:
    alone = np.zeros_like(x)
    alone[0, :n] = x[0, at : at + n]
    out = np.asarray(apply(variables, alone, mask=np.arange(N)[None] < n))[0, :n]
    worst = max(worst, rel_err(packed[at : at + n], out))
    at += n
  assert worst < 1e-9, worst
