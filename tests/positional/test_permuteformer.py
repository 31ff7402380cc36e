"""permuteformer: relative scores (1D offsets, 2D (row, col) offsets), the gather against dense
matrix powers P^i, non-negativity, the decay's KVMix, compatibility, per-head permutations
and seeds, lengths below / above the table."""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest

from fastpos import positional
from fastpos.positional import Context, Dims, KernelInfo, KVMix, compatibility, permuteformer
from tests.helpers import rel_err

HEADS, F = 3, 8
DIMS_1D = Dims(num_heads=HEADS, head_dim=4, feature_dim=F, embed_dim=12, max_length=12)
DIMS_1D_CAUSAL = Dims(
    num_heads=HEADS, head_dim=4, feature_dim=F, embed_dim=12, max_length=12, causal=True
)
DIMS_2D = Dims(num_heads=HEADS, head_dim=4, feature_dim=F, embed_dim=12, max_length=12, grid=(3, 4))
TOL = 1e-12


# ---------------------------------------------------------------------------------------------
# Building and applying (jitted once per configuration)
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _module(dims: Dims, options: tuple = ()):
  return positional.build("permuteformer", dims, dict(options))


@functools.lru_cache(maxsize=None)
def _features_fn(dims: Dims, options: tuple, ctx: Context):
  module = _module(dims, options)
  return jax.jit(lambda q, k: module.apply({}, q, k, ctx, method="features"))


def _features(dims: Dims, q, k, ctx: Context, options: tuple = ()):
  fq, fk = _features_fn(dims, options, ctx)(q, k)
  return np.asarray(fq), np.asarray(fk)


def _bound(dims: Dims, options: tuple = ()):
  """The module bound to (empty) variables, to call its python methods."""
  return _module(dims, options).bind({})


def _positive(rng, *shape):
  """Non-negative features like phi(x) = relu(x) + eps (Eq. 15)."""
  return np.maximum(rng.standard_normal(shape), 0.0) + 1e-3


def _scores(fq, fk):
  """``[b, h, Lq, Lk]`` = fq_i . fk_j."""
  return np.einsum("bihf,bjhf->bhij", fq, fk)


def _dense_powers(perm: np.ndarray, n: int) -> np.ndarray:
  """``[n, heads, f, f]`` P^i by matrix powers of ``(P)_{ab} = 1 iff pi(a) = b`` (Eq. 10)."""
  heads, f = perm.shape
  out = np.zeros((n, heads, f, f))
  for h in range(heads):
    base = np.zeros((f, f))
    base[np.arange(f), perm[h]] = 1.0
    for i in range(n):
      out[i, h] = np.linalg.matrix_power(base, i)
  return out


# ---------------------------------------------------------------------------------------------
# (1) relative scores
# ---------------------------------------------------------------------------------------------
def test_scores_of_fixed_vectors_depend_on_the_offset_only_1d():
  rng = np.random.default_rng(0)
  n = 12
  a, b = _positive(rng, 1, 1, HEADS, F), _positive(rng, 1, 1, HEADS, F)
  q, k = np.broadcast_to(a, (1, n, HEADS, F)), np.broadcast_to(b, (1, n, HEADS, F))
  s = _scores(*_features(DIMS_1D, q, k, Context(length=n)))
  # Toeplitz: (i, j) and (i+1, j+1) share j - i.
  assert rel_err(s[..., 1:, 1:], s[..., :-1, :-1]) < TOL
  # ... and the offsets are really told apart (else the test proves nothing).
  assert np.ptp(s[0, 0, 0]) > 1e-2 * np.max(s)


@pytest.mark.parametrize("shift", [1, 3, 7])
def test_shifting_the_real_tokens_keeps_their_scores_1d(shift):
  # The same n tokens at positions 0..n-1 and, after `shift` padded slots, at shift..shift+n-1.
  rng = np.random.default_rng(shift)
  n = 5
  q, k = _positive(rng, 2, n, HEADS, F), _positive(rng, 2, n, HEADS, F)
  pad_q, pad_k = _positive(rng, 2, shift, HEADS, F), _positive(rng, 2, shift, HEADS, F)
  s0 = _scores(*_features(DIMS_1D, q, k, Context(length=n)))
  qs, ks = np.concatenate([pad_q, q], axis=1), np.concatenate([pad_k, k], axis=1)
  s1 = _scores(*_features(DIMS_1D, qs, ks, Context(length=n + shift)))
  assert rel_err(s1[..., shift:, shift:], s0) < TOL


def test_memory_queries_sit_after_the_memory_keys():
  rng = np.random.default_rng(1)
  lq, m = 4, 7
  q, k = _positive(rng, 2, m + lq, HEADS, F), _positive(rng, 2, m + lq, HEADS, F)
  fq_full, fk_full = _features(DIMS_1D, q, k, Context(length=m + lq))
  fq, fk = _features(DIMS_1D, q[:, m:], k, Context(length=lq, memory_length=m))
  np.testing.assert_array_equal(fq, fq_full[:, m:])
  np.testing.assert_array_equal(fk, fk_full)


@pytest.mark.parametrize("grid", [(3, 4), (2, 3)])
def test_scores_depend_on_the_2d_offset_only(grid):
  rng = np.random.default_rng(2)
  h, w = grid
  n = h * w
  a, b = _positive(rng, 1, 1, HEADS, F), _positive(rng, 1, 1, HEADS, F)
  q, k = np.broadcast_to(a, (1, n, HEADS, F)), np.broadcast_to(b, (1, n, HEADS, F))
  s = _scores(*_features(DIMS_2D, q, k, Context(length=n, grid=grid)))[0]  # [h, n, n]
  groups: dict[tuple, list] = {}
  for p in range(n):
    for p2 in range(n):
      groups.setdefault((p2 // w - p // w, p2 % w - p % w), []).append(s[:, p, p2])
  spread = max(np.max(np.ptp(np.stack(g), axis=0)) for g in groups.values())
  assert spread / np.max(s) < TOL
  # A true 2D score: offsets with the same raster distance, (0, +1) and (1, 1 - w), differ.
  assert np.max(np.abs(groups[(0, 1)][0] - groups[(1, 1 - w)][0])) > 1e-2 * np.max(s)


# ---------------------------------------------------------------------------------------------
# (2) the gather against explicit dense permutation matrices
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 5, 12])
def test_gather_matches_dense_matrix_powers_1d(n):
  rng = np.random.default_rng(n)
  q, k = rng.standard_normal((2, n, HEADS, F)), rng.standard_normal((2, n, HEADS, F))
  perm = _bound(DIMS_1D).permutations()[0]
  mats = _dense_powers(perm, n)  # [n, h, f, f]
  want_q = np.einsum("nhac,bnhc->bnha", mats, q)
  want_k = np.einsum("nhac,bnhc->bnha", mats, k)
  fq, fk = _features(DIMS_1D, q, k, Context(length=n))
  assert rel_err(fq, want_q) < TOL and rel_err(fk, want_k) < TOL
  # The layer's reference mode (one-hot matrices from the table) agrees too.
  rq, rk = _features(DIMS_1D, q, k, Context(length=n, reference=True))
  assert rel_err(rq, want_q) < TOL and rel_err(rk, want_k) < TOL
  # Scores: q_i^T P^(j-i) k_j (Eq. 11 with r = 1).
  inv = lambda i, j: mats[j - i] if j >= i else np.swapaxes(mats[i - j], -1, -2)
  want_s = np.array(
      [
          [np.einsum("bha,hac,bhc->bh", q[:, i], inv(i, j), k[:, j]) for j in range(n)]
          for i in range(n)
      ]
  )  # [n, n, b, h]
  assert rel_err(_scores(fq, fk), np.transpose(want_s, (2, 3, 0, 1))) < TOL


@pytest.mark.parametrize("grid", [(3, 4), (2, 2), (1, 4)])
def test_gather_matches_dense_matrix_powers_2d(grid):
  rng = np.random.default_rng(sum(grid))
  h, w = grid
  n = h * w
  q, k = rng.standard_normal((2, n, HEADS, F)), rng.standard_normal((2, n, HEADS, F))
  perms = _bound(DIMS_2D).permutations()
  rows, cols = _dense_powers(perms[0], h), _dense_powers(perms[1], w)
  mats = np.stack([rows[p // w] @ cols[p % w] for p in range(n)])  # P_row^r P_col^c
  # The two permutations commute (disjoint supports, Eq. 14).
  np.testing.assert_array_equal(mats, np.stack([cols[p % w] @ rows[p // w] for p in range(n)]))
  want_q = np.einsum("nhac,bnhc->bnha", mats, q)
  want_k = np.einsum("nhac,bnhc->bnha", mats, k)
  for reference in (False, True):
    fq, fk = _features(DIMS_2D, q, k, Context(length=n, grid=grid, reference=reference))
    assert rel_err(fq, want_q) < TOL and rel_err(fk, want_k) < TOL


def test_2d_halves_move_with_their_axis_only():
  perms = _bound(DIMS_2D).permutations()
  half = F - F // 2
  np.testing.assert_array_equal(
      perms[0][:, half:], np.broadcast_to(np.arange(half, F), (HEADS, F - half))
  )
  np.testing.assert_array_equal(perms[1][:, :half], np.broadcast_to(np.arange(half), (HEADS, half)))
  assert not np.any(np.all(perms[0] == np.arange(F), axis=-1))  # neither is the identity
  assert not np.any(np.all(perms[1] == np.arange(F), axis=-1))


@pytest.mark.parametrize("n", [0, 1, 2, 5, 40])
def test_power_table_matches_repeated_composition(n):
  rng = np.random.default_rng(3)
  perm = np.stack([rng.permutation(13) for _ in range(4)])
  table = permuteformer.power_table(perm, n)
  assert table.shape == (n, 4, 13)
  step = np.broadcast_to(np.arange(13), (4, 13)).copy()
  for i in range(n):
    np.testing.assert_array_equal(table[i], step)
    step = np.take_along_axis(perm, step, axis=-1)  # pi^(i+1) = pi o pi^i


# ---------------------------------------------------------------------------------------------
# (3) non-negativity
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dims, grid", [(DIMS_1D, None), (DIMS_2D, (3, 4))])
def test_features_stay_nonnegative(dims, grid):
  rng = np.random.default_rng(4)
  n = 12
  q, k = _positive(rng, 2, n, HEADS, F), _positive(rng, 2, n, HEADS, F)
  fq, fk = _features(dims, q, k, Context(length=n, grid=grid))
  assert np.all(fq > 0) and np.all(fk > 0)
  # A permutation: the same values per token, only their order changes.
  np.testing.assert_array_equal(np.sort(fq, axis=-1), np.sort(q, axis=-1))
  np.testing.assert_array_equal(np.sort(fk, axis=-1), np.sort(k, axis=-1))
  assert permuteformer.PermuteFormer.keeps_nonnegative


# ---------------------------------------------------------------------------------------------
# (4) the decay's KVMix
# ---------------------------------------------------------------------------------------------
def test_kv_mix_log_decay():
  ctx = Context(causal=True, length=5)
  mix = _bound(DIMS_1D_CAUSAL, (("decay", 0.9),)).kv(ctx)
  assert mix.log_table is None
  assert mix.log_decay.shape == (HEADS,)
  assert rel_err(mix.log_decay, np.full(HEADS, np.log(0.9))) < TOL
  per_head = (0.8, 0.95, 1.0)
  mix = _bound(DIMS_1D_CAUSAL, (("decay", per_head),)).kv(ctx)
  assert rel_err(mix.log_decay, np.log(per_head)) < TOL
  for dims in (DIMS_1D, DIMS_1D_CAUSAL):
    assert _bound(dims).kv(Context(causal=dims.causal, length=5)) == KVMix()


def test_without_permutation_only_the_decay_remains():
  """The paper's "w/o P_pi" ablation (Table 4): features pass unchanged, the decay stays."""
  rng = np.random.default_rng(3)
  q, k = _positive(rng, 2, 6, HEADS, F), _positive(rng, 2, 6, HEADS, F)
  opts = (("decay", 0.9), ("permute", False))
  fq, fk = _features(DIMS_1D_CAUSAL, q, k, Context(causal=True, length=6), opts)
  np.testing.assert_array_equal(fq, q)
  np.testing.assert_array_equal(fk, k)
  mix = _bound(DIMS_1D_CAUSAL, opts).kv(Context(causal=True, length=6))
  assert rel_err(mix.log_decay, np.full(HEADS, np.log(0.9))) < TOL
  # With the permutation the features do move.
  pq, _ = _features(DIMS_1D_CAUSAL, q, k, Context(causal=True, length=6), (("decay", 0.9),))
  assert np.abs(pq - q).max() > 1e-3
  with pytest.raises(ValueError, match="permute must be True or False"):
    compatibility.problem("relu", "permuteformer", causal=True, options={"permute": "no"})


def test_paper_decay_ladder():
  r = permuteformer.paper_decays(8)
  assert len(r) == 8 and np.all(np.diff(r) > 0)
  want = 1.0 / (1.0 + np.exp(-(2.0 + 3.0 * np.arange(8) / 8)))
  assert rel_err(r, want) < TOL
  assert 0.88 < r[0] < 0.881 and 0.99 < r[-1] < 0.991  # Sec. 4.2.1: r in [0.88, 0.99]
  mix = _bound(DIMS_1D_CAUSAL, (("decay", permuteformer.paper_decays(HEADS)),)).kv(
      Context(causal=True, length=3)
  )
  assert rel_err(mix.log_decay, np.log(permuteformer.paper_decays(HEADS))) < TOL
  named = _bound(DIMS_1D_CAUSAL, (("decay", "paper"),)).kv(Context(causal=True, length=3))
  assert rel_err(named.log_decay, mix.log_decay) < TOL  # "paper" = the ladder for any heads
  assert "Eq. 10" in compatibility.problem(
      "relu", "permuteformer", causal=False, options={"decay": "paper"}
  )


def test_decay_is_refused_where_it_is_not_defined():
  with pytest.raises(ValueError, match="causal"):
    _bound(DIMS_1D, (("decay", 0.9),)).kv(Context(length=3))
  with pytest.raises(ValueError, match="one per head"):
    _bound(DIMS_1D_CAUSAL, (("decay", (0.9, 0.8)),)).kv(Context(causal=True, length=3))


# ---------------------------------------------------------------------------------------------
# (5) compatibility and options
# ---------------------------------------------------------------------------------------------
def test_compatibility():
  cls = permuteformer.PermuteFormer
  trf = cls.compatibility(KernelInfo("trf"), causal=False, two_d=False, options={})
  assert isinstance(trf, str) and "non-negative" in trf and "trf" in trf
  for kernel in ("softmax", "relu", "elu1", "favor", "dpfp"):
    for causal in (False, True):
      for two_d in (False, True):
        assert compatibility.problem(kernel, "permuteformer", causal=causal, two_d=two_d) is None
  assert "non-negative" in compatibility.problem("trf", "permuteformer", causal=True)
  # r < 1: causal only (Eq. 10: r = 1 for bidirectional models).
  for kernel in ("softmax", "relu"):
    why = compatibility.problem(kernel, "permuteformer", causal=False, options={"decay": 0.9})
    assert isinstance(why, str) and "Eq. 10" in why
    why = compatibility.problem(
        kernel, "permuteformer", causal=False, options={"decay": (1.0, 0.9)}
    )
    assert isinstance(why, str)
    assert (
        compatibility.problem(kernel, "permuteformer", causal=True, options={"decay": 0.9}) is None
    )
  assert (
      compatibility.problem("relu", "permuteformer", causal=False, options={"decay": 1.0}) is None
  )


@pytest.mark.parametrize("decay", [0.0, -0.5, 1.5, float("nan"), True, "0.9", (), (0.9, 2.0)])
def test_bad_decay_raises(decay):
  with pytest.raises(ValueError, match=re.escape("(0, 1]")):
    compatibility.problem("relu", "permuteformer", causal=True, options={"decay": decay})
  with pytest.raises(ValueError, match=re.escape("(0, 1]")):
    _bound(DIMS_1D_CAUSAL, (("decay", decay),)).kv(Context(causal=True, length=3))


def test_bad_options_raise():
  with pytest.raises(ValueError, match="seed"):
    compatibility.problem("relu", "permuteformer", options={"seed": -1})
  with pytest.raises(ValueError, match="unknown option"):
    positional.build("permuteformer", DIMS_1D, {"r": 0.9})
  with pytest.raises(ValueError, match="bidirectional"):
    _bound(DIMS_1D, (("decay", 0.5),)).kv(Context(length=3))
  small = Dims(num_heads=1, head_dim=2, feature_dim=3, embed_dim=2, max_length=4, grid=(2, 2))
  with pytest.raises(ValueError, match="feature dim >= 4"):
    _bound(small).kv(Context(length=4, grid=(2, 2)))
  with pytest.raises(ValueError, match=r"\[batch, length, 3, 8\]"):
    _features(DIMS_1D, np.zeros((1, 4, HEADS, 5)), np.zeros((1, 4, HEADS, 5)), Context(length=4))
  with pytest.raises(ValueError, match="without one"):
    _features(DIMS_2D, np.zeros((1, 4, HEADS, F)), np.zeros((1, 4, HEADS, F)), Context(length=4))


# ---------------------------------------------------------------------------------------------
# (6) per-head permutations and seeds
# ---------------------------------------------------------------------------------------------
def test_heads_differ_and_seeds_reproduce():
  for dims in (DIMS_1D, DIMS_2D):
    perms = _bound(dims).permutations()  # [axes, h, f]
    for p in perms.reshape(-1, F):
      np.testing.assert_array_equal(np.sort(p), np.arange(F))  # real permutations
    per_head = [perms[:, h].tobytes() for h in range(HEADS)]
    assert len(set(per_head)) == HEADS  # every head its own
    again = permuteformer.draw_permutations.__wrapped__(F, HEADS, 0, dims.grid is not None)
    np.testing.assert_array_equal(again, perms)  # same seed, same draw
    other = _bound(dims, (("seed", 1),)).permutations()
    assert not np.array_equal(other, perms)
  rng = np.random.default_rng(5)
  n = 12
  q, k = rng.standard_normal((1, n, HEADS, F)), rng.standard_normal((1, n, HEADS, F))
  fq = _features(DIMS_1D, q, k, Context(length=n))[0]
  # Heads given the same input are permuted differently ...
  same = np.broadcast_to(q[:, :, :1], q.shape)
  fs = _features(DIMS_1D, same, same, Context(length=n))[0]
  assert not np.array_equal(fs[:, 1:, 0], fs[:, 1:, 1])
  assert not np.array_equal(fs[:, 1:, 1], fs[:, 1:, 2])
  # ... and a fresh module with the same seed gives the same features (another seed does not).
  fresh = positional.build("permuteformer", DIMS_1D, {"seed": 0})
  fq2, _ = fresh.apply({}, q, k, Context(length=n), method="features")
  np.testing.assert_array_equal(np.asarray(fq2), fq)
  assert not np.array_equal(_features(DIMS_1D, q, k, Context(length=n), (("seed", 1),))[0], fq)


# ---------------------------------------------------------------------------------------------
# (7) lengths below and above the table
# ---------------------------------------------------------------------------------------------
def test_shorter_lengths_use_the_first_rows_and_longer_raise():
  rng = np.random.default_rng(6)
  q, k = rng.standard_normal((2, 12, HEADS, F)), rng.standard_normal((2, 12, HEADS, F))
  full = _features(DIMS_1D, q, k, Context(length=12))
  for n in (1, 7):
    part = _features(DIMS_1D, q[:, :n], k[:, :n], Context(length=n))
    np.testing.assert_array_equal(part[0], full[0][:, :n])
    np.testing.assert_array_equal(part[1], full[1][:, :n])
  long = np.zeros((1, 13, HEADS, F))
  with pytest.raises(ValueError, match="dims.max_length = 12"):
    _features(DIMS_1D, long, long, Context(length=13))
  with pytest.raises(ValueError, match="dims.max_length = 12"):  # memory counts too
    _features(DIMS_1D, long[:, :4], long[:, :13], Context(length=4, memory_length=9))
  big = np.zeros((1, 16, HEADS, F))
  with pytest.raises(ValueError, match=re.escape("exceeds the largest grid (3, 4)")):
    _features(DIMS_2D, big, big, Context(length=16, grid=(4, 4)))
