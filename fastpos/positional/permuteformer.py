"""``permuteformer``: a position-aware permutation of the features, with a causal decay r.

Chen, "PermuteFormer: Efficient Relative Position Encoding for Long Sequences" (EMNLP 2021).
With a fixed random permutation pi per head and its matrix ``P_pi`` (``(P_pi x)_a =
x_{pi(a)}``), query i and key j score (Eq. 11)

    sim(q_i, k_j) = (r^i P_pi^i phi(q_i))^T (r^-j P_pi^j phi(k_j))
                  = r^(i-j) phi(q_i)^T P_pi^(j-i) phi(k_j)

a function of j - i only, non-negative for non-negative phi. The features hook applies
``P_pi^i`` as a gather with a precomputed table of pi^i; the decay r^(i-j) comes from the
``kv`` hook (``log r`` per head; r < 1 needs a causal model, Eq. 10). 2D (Eq. 14): one
permutation moves the first half of the features by the row, another the rest by the column.

Shapes: q ``[batch, Lq, heads, f]``, k ``[batch, Lk, heads, f]`` (f = head_dim for softmax, m
for linear kernels: post_phi) -> the same. Positions must be < ``dims.max_length`` (2D: within
``dims.grid``). Causal, 1D and 2D; softmax and every linear kernel with non-negative features
(``trf`` is refused: Property 3). No parameters. Options: ``PermuteFormer.option_spec``
(``decay="paper"``: the authors' per-head ladder ``paper_decays``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fastpos.positional.base import (
    Context,
    KernelInfo,
    KVMix,
    Option,
    Scheme,
    query_key_positions,
)

SCHEME = "permuteformer"


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------
PAPER_DECAY = "paper"  # the ``decay`` option value that asks for ``paper_decays(num_heads)``
_RATE = Option(1.0, "", type="number", low=0, low_open=True, high=1)


def _valid_decay(decay) -> bool:
  if isinstance(decay, str):
    return decay == PAPER_DECAY
  values = tuple(decay) if isinstance(decay, (tuple, list, np.ndarray)) else (decay,)
  return bool(values) and all(_RATE.is_valid(r) for r in values)


def decays(decay, num_heads: int = 1) -> tuple[float, ...]:
  """A valid ``decay`` option (a number, per-head numbers or ``"paper"``) -> per-head floats
  (one value, or ``num_heads`` values)."""
  if isinstance(decay, str):
    return paper_decays(num_heads)
  values = tuple(decay) if isinstance(decay, (tuple, list, np.ndarray)) else (decay,)
  return tuple(float(r) for r in values)


def paper_decays(num_heads: int) -> tuple[float, ...]:
  """Per-head r spanning the paper's WikiText-103 range (Sec. 4.2.1, r in [0.88, 0.99]) as the
  authors' released code sets it: ``sigmoid(2 + 3 k / h)``, k = 0..h-1."""
  return tuple(float(1.0 / (1.0 + np.exp(-(2.0 + 3.0 * k / num_heads)))) for k in range(num_heads))


def group_sizes(f: int, two_d: bool) -> tuple[int, ...]:
  """Features per axis: (f,) in 1D; (ceil(f/2) following the row, floor(f/2) the column)."""
  return (f - f // 2, f // 2) if two_d else (f,)


def check_feature_dim(f: int, two_d: bool) -> None:
  """Each axis needs >= 2 features, else its permutation is the identity (no position)."""
  need = 4 if two_d else 2
  if f < need:
    where = "2D (rows and columns each permute their own half)" if two_d else "1D"
    raise ValueError(f"{SCHEME}: needs a feature dim >= {need} in {where}; got {f}.")


# ---------------------------------------------------------------------------------------------
# Permutations and their powers (numpy, static)
# ---------------------------------------------------------------------------------------------
def _num_non_identity(g: int) -> int:
  """g! - 1, capped (only compared with a number of heads)."""
  return math.factorial(min(g, 12)) - 1


@functools.lru_cache(maxsize=64)
def draw_permutations(f: int, heads: int, seed: int, two_d: bool) -> np.ndarray:
  """The base permutations, ``[axes, heads, f]`` int64 (axes = 1 in 1D, 2 in 2D), each row a
  permutation of 0..f-1 (``pi(a) = perm[a]``). In 2D, axis 0 (rows) moves only the first
  ceil(f/2) features and axis 1 (columns) only the others, so the two commute."""
  check_feature_dim(f, two_d)
  sizes = group_sizes(f, two_d)
  rng = np.random.default_rng(seed)
  # Heads can all differ only if there are enough non-identity permutations (tuples).
  distinct = math.prod(_num_non_identity(g) for g in sizes) >= heads
  out = np.tile(np.arange(f), (len(sizes), heads, 1))
  seen: set[tuple] = set()
  for h in range(heads):
    while True:
      parts = []
      for g in sizes:
        perm = rng.permutation(g)
        while np.array_equal(perm, np.arange(g)):  # the identity carries no position
          perm = rng.permutation(g)
        parts.append(perm)
      signature = tuple(tuple(p.tolist()) for p in parts)
      if not (distinct and signature in seen):
        break
    seen.add(signature)
    lo = 0
    for axis, (g, perm) in enumerate(zip(sizes, parts)):
      out[axis, h, lo : lo + g] = lo + perm
      lo += g
  out.setflags(write=False)
  return out


def power_table(perm: np.ndarray, n: int) -> np.ndarray:
  """``[n, heads, f]``: row i holds pi^i (``table[i, h, a] = pi_h^i(a)``) for ``perm [heads, f]``
  (``pi_h(a) = perm[h, a]``), by doubling: rows s..2s-1 are ``pi^s o pi^i``, i < s, then
  ``pi^2s = pi^s o pi^s``: O(n heads f) work in log2(n) numpy gathers."""
  heads, f = perm.shape
  dtype = np.int16 if f < 2**15 else np.int32
  table = np.empty((max(n, 0), heads, f), dtype)
  if n > 0:
    table[0] = np.arange(f)
  done, step = min(n, 1), np.asarray(perm, np.int64)  # step = pi^done
  while done < n:
    take = min(done, n - done)
    block = table[:take].astype(np.int64)  # pi^i, i < take
    table[done : done + take] = np.take_along_axis(
        np.broadcast_to(step[None], block.shape), block, axis=-1
    )  # pi^done o pi^i
    step = np.take_along_axis(step, step, axis=-1)  # pi^(2 done)
    done += take
  table.setflags(write=False)
  return table


@functools.lru_cache(maxsize=32)
def _tables(f: int, heads: int, seed: int, sizes: tuple[int, ...]) -> tuple[np.ndarray, ...]:
  """One power table per axis: ``[sizes[a], heads, f]`` (1D: (max_length,); 2D: (H, W))."""
  perms = draw_permutations(f, heads, seed, len(sizes) == 2)
  return tuple(power_table(perms[a], n) for a, n in enumerate(sizes))


# ---------------------------------------------------------------------------------------------
# Applying P^i (pure jax)
# ---------------------------------------------------------------------------------------------
def permute(x, index):
  """``y[..., n, h, a] = x[..., n, h, index[n, h, a]]``: x ``[batch, N, heads, f]``, index
  ``[N, heads, f]`` integer (``P^{pos_n}`` as a gather)."""
  idx = jnp.broadcast_to(jnp.asarray(index)[None], x.shape)
  # In range by construction; the default mode's negative-index fix-up would be
  # constant-folded over the whole table at compile time (4x slower compiles, measured).
  return jnp.take_along_axis(x, idx, axis=-1, mode="promise_in_bounds")


def permute_dense(x, index):
  """The dense reference of ``permute``: one-hot matrices ``[N, heads, f, f]`` applied by an
  einsum (O(N f^2); tests and ``ctx.reference`` only)."""
  f = x.shape[-1]
  mats = (jnp.asarray(index)[..., None] == jnp.arange(f).reshape(1, 1, 1, f)).astype(x.dtype)
  return jnp.einsum("nhac,bnhc->bnha", mats, x, precision=jax.lax.Precision.HIGHEST)


# ---------------------------------------------------------------------------------------------
# The scheme
# ---------------------------------------------------------------------------------------------
class PermuteFormer(Scheme):
  """Options: ``option_spec``."""

  option_spec = {
      "decay": Option(
          1.0,
          "r of the causal decay r^(i-j) (Eq. 10), one or per head",
          check=_valid_decay,
          annotation="float | tuple[float, ...]",
          valid=f"a number r in (0, 1], a non-empty sequence of per-head r in "
          f"(0, 1] (1 = no decay) or {PAPER_DECAY!r} (the paper's per-head ladder)",
      ),
      "seed": Option(
          0,
          "draws the permutations",
          type="int",
          low=0,
          used_when=lambda o, two_d: o["permute"],
          used_doc="with permute=True only (permute=False keeps the decay alone)",
      ),
      "permute": Option(
          True,
          'False keeps only the decay r^(i-j): the paper\'s "w/o P_pi" ' "ablation (Table 4)",
          type="bool",
      ),
  }

  scheme_name = SCHEME
  hooks = ("features", "kv")
  feature_stage = "post_phi"
  keeps_nonnegative = True
  supports_causal = True
  supports_1d = True
  supports_2d = True
  permutes_features = True  # pi^i only (its decay is the kv hook)

  @classmethod
  def compatibility(
      cls, kernel: KernelInfo, *, causal: bool, two_d: bool, options: dict
  ) -> str | None:
    if not kernel.is_softmax and not kernel.nonnegative:
      return (
          f"PermuteFormer needs non-negative features (its Property 3); {kernel.name!r} "
          f"has signed features, so the linear-attention denominator can vanish"
      )
    if not causal and min(decays(options["decay"])) < 1.0:
      return (
          f"decay r = {options.get('decay')!r} < 1 needs a causal model: the paper sets "
          f"r = 1 for bidirectional models (Eq. 10), since r^(i-j) is unbounded for keys "
          f"after the query (Property 2)"
      )
    return None

  @classmethod
  def kv_terms(cls, options=None, *, causal: bool) -> tuple[str, ...]:
    """A causal decay r < 1 is the kv hook's ``log_decay``; with r = 1 it returns nothing."""
    decay = cls.resolve_options(options)["decay"]
    return ("decay",) if causal and min(decays(decay)) < 1.0 else ()

  def setup(self):
    h, f = self.dims.num_heads, self.dims.feature_dim
    self._decays = decays(self.decay, h)
    if len(self._decays) not in (1, h):
      raise ValueError(
          f"{SCHEME}: decay has {len(self._decays)} values; give one r or one per " f"head ({h})."
      )
    if not self.dims.causal and min(self._decays) < 1.0:
      raise ValueError(
          f"{SCHEME}: decay {self.decay!r} < 1 needs a causal model (Eq. 10: "
          f"r = 1 for bidirectional models)."
      )
    two_d = self.dims.grid is not None
    check_feature_dim(f, two_d)
    sizes = tuple(int(g) for g in self.dims.grid) if two_d else (self.dims.max_length,)
    self._powers = _tables(f, h, self.seed, sizes)

  def permutations(self) -> np.ndarray:
    """The base permutations ``[axes, heads, f]`` (see ``draw_permutations``)."""
    return draw_permutations(
        self.dims.feature_dim, self.dims.num_heads, self.seed, self.dims.grid is not None
    )

  def index(self, pos: np.ndarray) -> np.ndarray:
    """``[L, heads, f]`` gather index of ``P^pos`` for integer positions ``pos [L, c]`` (c = 1:
    sequence position; c = 2: (row, column))."""
    if self.dims.grid is None:
      p = pos[:, 0]
      top = int(p.max()) if p.size else -1
      if top >= self.dims.max_length:
        raise ValueError(
            f"{SCHEME}: position {top} (sequence length {top + 1}, memory included) exceeds "
            f"the table of pi^i built for positions < dims.max_length = "
            f"{self.dims.max_length}; raise max_length (model.max_length in a config)."
        )
      return self._powers[0][p]
    rows, cols = self._powers
    # Disjoint supports: composing the row and column gathers in either order is P_row^r P_col^c.
    return np.take_along_axis(cols[pos[:, 1]], rows[pos[:, 0]].astype(np.int64), axis=-1)

  def features(self, q, k, ctx: Context):
    """q ``[b, Lq, h, f]``, k ``[b, Lk, h, f]`` -> ``(P^{pos(i)} q_i, P^{pos(j)} k_j)``, same
    shapes and dtypes (Eq. 11 without r; Eq. 14 on a grid)."""
    f, h = self.dims.feature_dim, self.dims.num_heads
    for name, x in (("q", q), ("k", k)):
      if x.ndim != 4 or x.shape[2] != h or x.shape[-1] != f:
        raise ValueError(
            f"{SCHEME}: {name} must be [batch, length, {h}, {f}] (heads, "
            f"dims.feature_dim); got {x.shape}."
        )
    if ctx.grid is not None and self.dims.grid is not None:
      (gh, gw), (mh, mw) = tuple(ctx.grid), tuple(self.dims.grid)
      if gh > mh or gw > mw:
        raise ValueError(
            f"{SCHEME}: grid {tuple(ctx.grid)} exceeds the largest grid "
            f"{tuple(self.dims.grid)} the permutation tables were built for; "
            f"build the model for the larger grid (TaskInfo.grid)."
        )
    if not self.permute:  # "w/o P_pi": positions enter only through the decay (kv)
      return q, k
    pos_q, pos_k = query_key_positions(q, k, ctx, two_d=self.dims.grid is not None, scheme=SCHEME)
    apply = permute_dense if ctx.reference else permute
    if ctx.offset is not None:  # decoding: traced positions gather rows of the power table
      index = jnp.take(jnp.asarray(self._powers[0]), pos_q[:, 0], axis=0, mode="clip")
      return apply(q, index), apply(k, index)
    index_k = jnp.asarray(self.index(pos_k))
    # Without memory queries and keys share positions: one table constant serves both.
    index_q = index_k if np.array_equal(pos_q, pos_k) else jnp.asarray(self.index(pos_q))
    return apply(q, index_q), apply(k, index_k)

  def kv(self, ctx: Context) -> KVMix:
    """``KVMix(log_decay=[heads] log r)`` for the causal decay r^(i-j); ``KVMix()`` if r = 1."""
    if min(self._decays) == 1.0:
      return KVMix()
    if not ctx.causal:
      raise ValueError(f"{SCHEME}: decay {self.decay!r} < 1 needs causal attention (Eq. 10).")
    log_r = np.log(np.broadcast_to(np.asarray(self._decays), (self.dims.num_heads,)))
    return KVMix(log_decay=jnp.asarray(log_r))


SCHEMES = {"permuteformer": PermuteFormer}
