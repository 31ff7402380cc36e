"""Feature maps phi for kernelized (linear) attention.

Linear attention replaces the similarity exp(q.k) by phi(q).phi(k) (Luo et al. Eq. 3), so the
sums over keys ``sum_j phi(k_j) v_j^T`` and ``sum_j phi(k_j)`` are shared by every query.

  deterministic: ``elu1`` (Katharopoulos et al.), ``relu`` (+eps), ``sikf`` (exp, FastRPB
                 Sec. 3.1), ``dpfp`` (Schlag et al. 2021)
  random:        ``prf`` (Luo Eq. 5), ``favor`` (PRF with the Performer stabiliser),
                 ``trf`` (Luo Eq. 4), ``nprf`` (PRF on L2-normalised inputs, Luo Sec. 3.3),
                 ``orf`` (``favor`` fed an orthogonal projection)

Conventions:
  * ``x`` is ``[batch, length, heads, dim]``; every map returns ``[batch, length, heads, m]``.
  * A random map takes its projection ``w`` as an argument: ``[m, dim]`` shared by all heads or
    ``[heads, m, dim]`` one per head, built from an explicit PRNG key by
    ``gaussian_projection`` / ``orthogonal_projection`` / ``make_projection``. Nothing here draws
    randomness itself; redrawing is the caller passing a new key.
  * Compute runs in float32 for float32 / bfloat16 / float16 inputs and in float64 when ``x`` or
    the projection is float64; the result stays in that compute dtype (bf16 in, float32 out):
    exp-features under- and overflow bf16 and are summed over the whole sequence.
  * ``sikf`` and ``favor`` subtract a stabilising max that cancels between the numerator and the
    denominator of attention (see ``_stabilizer``; causal keys take the first real key's, so no
    output depends on a later key); the other maps are plain formulas.
  * ``Kernel`` is the one record of a kernel (``softmax`` included): its name and options, and
    as properties the facts of its ``FeatureMap`` (the map as a typed callable with named
    arguments, its projection, softmax scaling, sign, output size, options and, for the
    exponential maps, the ``ExpForm`` that lets causal layers and decoding keep the keys'
    scale apart: ``Kernel.scaled_keys``, ``Kernel.stabilised``).
    ``get_kernel(name)`` gives it with default options; ``feature_map`` / ``make_projection`` /
    ``feature_dim`` / ``needs_projection`` / ``is_nonnegative`` read it; so do the attention
    layer (``fastpos.models.KernelSpec``), the schemes (``fastpos.positional.KernelInfo``), the
    kernel x scheme table and decoding: three names of this one class.
  * Every check runs on static shapes before any compute and raises ``ValueError``. The maps
    and projections are jitted (flags and sizes static), so eager calls compile once per shape
    and calls inside a caller's jit inline.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
from typing import Callable, Mapping, Protocol

import jax
import jax.numpy as jnp

from fastpos.ops.kernel_options import OPTIONS
from fastpos.ops.masks import check_mask


# ---------------------------------------------------------------------------------------------
# Validation and dtype helpers (static shapes only)
# ---------------------------------------------------------------------------------------------
def _check_x(x) -> None:
  if jnp.ndim(x) != 4:
    raise ValueError(f"x must be [batch, length, heads, dim] (rank 4); got shape {jnp.shape(x)}.")


def _check_mask(mask, x) -> None:
  check_mask(mask, x.shape[:2], against=f"x of shape {tuple(x.shape)}")


def _check_projection(projection, x, name: str = "this feature map") -> None:
  if projection is None:
    raise ValueError(
        f"{name} is a random feature map and needs a projection [m, dim] or [heads, m, dim] "
        "(see make_projection); got None."
    )
  shape = tuple(jnp.shape(projection))
  if len(shape) not in (2, 3):
    raise ValueError(f"projection must be [m, dim] or [heads, m, dim]; got shape {shape}.")
  if shape[-1] != x.shape[-1]:
    raise ValueError(
        f"projection has last dim {shape[-1]} but x has dim={x.shape[-1]}; expected "
        f"[m, {x.shape[-1]}] or [heads, m, {x.shape[-1]}]."
    )
  if len(shape) == 3 and shape[0] != x.shape[2]:
    raise ValueError(f"projection has {shape[0]} heads but x has heads={x.shape[2]}.")


def _check_nu(nu, dim: int) -> None:
  valid = isinstance(nu, numbers.Integral) and not isinstance(nu, bool)
  if not valid or not 1 <= nu <= 2 * dim - 1:
    raise ValueError(
        f"dpfp nu must be an integer in [1, 2*dim-1] = [1, {2 * dim - 1}] for "
        f"dim={dim}; got {nu!r}."
    )


def _check_sizes(num_features, dim) -> None:
  for what, v in (("num_features", num_features), ("dim", dim)):
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
      raise ValueError(f"{what} must be a positive integer; got {v!r}.")


def _compute_dtype(*arrays):
  """float64 stays float64; everything else (bf16, f16, f32, ints) is computed in float32."""
  return jnp.float64 if jnp.result_type(*arrays) == jnp.float64 else jnp.float32


def _upcast(x):
  return x.astype(_compute_dtype(x))


# ---------------------------------------------------------------------------------------------
# Deterministic maps
# ---------------------------------------------------------------------------------------------
@jax.jit
def elu1(x):
  """ELU(x) + 1 (Katharopoulos et al. 2020). ``[b, l, h, d] -> [b, l, h, d]``."""
  _check_x(x)
  return jax.nn.elu(_upcast(x)) + 1.0


@functools.partial(jax.jit, static_argnames="eps")
def relu(x, *, eps: float = 1e-6):
  """ReLU(x) + eps; eps keeps the attention denominator positive. ``[b, l, h, d] -> same``."""
  _check_x(x)
  return jax.nn.relu(_upcast(x)) + eps


def _stabilizer(z, *, is_query: bool, mask, causal: bool = False):
  """The max that ``sikf`` / ``favor`` subtract from their exponent ``z`` ``[b, l, h, m]``.

  Queries: per token, over features -> ``[b, l, h, 1]``. It scales phi(q_i) by a positive
  constant, which cancels between numerator and denominator of query i's attention.
  Keys: ONE value per (batch, head) -> ``[b, 1, h, 1]``. It scales every phi(k_j) by the same
  constant, which cancels in the exponential part (``favor``'s eps, added after the scaling,
  is relative to it):

  * not causal: the max over the length and features of the real (mask True) keys, so no
    feature exceeds 1;
  * causal: the max over the features of the FIRST real key, which every real query sees.
    A max over all keys would make phi(k_j), and so query i's output, depend on keys after
    i: through favor's eps by O(eps), through rounding and underflow for both maps. The
    price: a later key whose max exceeds the first key's by more than ~88 (float32) gives an
    infinite feature (a NaN loss, not a silent leak).

  Both sit behind stop_gradient. The scale cancels in attention, so treating it as a constant
  leaves the gradient of attention exact; and it makes phi(k_i) depend, for autodiff, on k_i
  alone, so d phi(k_i) / d k_j = 0 exactly for j != i.
  """
  if is_query:
    m = jnp.max(z, axis=-1, keepdims=True)
  elif causal:
    top = jnp.max(z, axis=-1)  # [b, l, h]
    first = (
        jnp.zeros(top.shape[:1], jnp.int32)
        if mask is None
        else jnp.argmax(jnp.asarray(mask, bool), axis=1)
    )  # [b] the first real key
    m = jnp.take_along_axis(top, first[:, None, None], axis=1)[..., None]  # [b, 1, h, 1]
  else:
    if mask is not None:
      z = jnp.where(jnp.asarray(mask, bool)[:, :, None, None], z, -jnp.inf)
    m = jnp.max(z, axis=(1, 3), keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))  # a (batch, head) with no real key
  return jax.lax.stop_gradient(m)


@functools.partial(jax.jit, static_argnames=("is_query", "causal"))
def sikf(x, *, is_query: bool, mask=None, causal: bool = False):
  """Shift-invariant kernel function phi(x) = exp(x) (FastRPB Sec. 3.1), stabilised.

  sim(q, k) = sum_l exp(q_l + k_l), so adding a constant to all q or to all k scales every
  similarity of a query by the same factor and leaves the attention weights unchanged, as for
  softmax. Computed as exp(x - c) with c from ``_stabilizer``: the per-token max over features
  for queries, one max per (batch, head) over real keys for keys. What holds exactly: in exact
  arithmetic sikf(x + s) == sikf(x) for a scalar s (per query token, or per (batch, head) for
  keys), because c shifts by s too; in floating point the two differ only by the rounding of
  ``(x + s) - max(x + s)`` versus ``x - max(x)``, i.e. ~ulp(|x| + |s|) in the exponent.

  Args:
    x: ``[batch, length, heads, dim]``.
    is_query: per-token stabiliser (queries) or one per (batch, head) (keys).
    causal: keys only: the stabiliser is the first real key's (``_stabilizer``), so no
      feature depends on a later key.
    mask: optional ``[batch, length]`` bool, True = real token; padded keys are left out of the
      key max. Their features are still computed (and may overflow if the padded values exceed
      the real ones by ~88 in float32); the attention op zeros them.

  Returns:
    ``[batch, length, heads, dim]``, all >= 0, the max feature of each query token (and of the
    keys of each (batch, head)) equal to 1.
  """
  _check_x(x)
  _check_mask(mask, x)
  x = _upcast(x)
  return jnp.exp(x - _stabilizer(x, is_query=is_query, mask=mask, causal=causal))


@functools.partial(jax.jit, static_argnames="nu")
def dpfp(x, *, nu: int = 1):
  """Deterministic parameter-free projection (Schlag et al. 2021; FastRPB Eq. 6).

  x' = [ReLU(x), ReLU(-x)] (2d), phi = concat_{j=1..nu} x' * roll(x', j, axis=-1).
  ``[b, l, h, d] -> [b, l, h, 2 d nu]``; nu is an integer in [1, 2d-1].
  """
  _check_x(x)
  _check_nu(nu, x.shape[-1])
  x = _upcast(x)
  xp = jnp.concatenate([jax.nn.relu(x), jax.nn.relu(-x)], axis=-1)
  return jnp.concatenate([xp * jnp.roll(xp, j, axis=-1) for j in range(1, nu + 1)], axis=-1)


# ---------------------------------------------------------------------------------------------
# Projections (the only source of randomness)
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("num_features", "dim", "dtype"))
def gaussian_projection(key, num_features: int, dim: int, *, dtype=jnp.float32):
  """``[num_features, dim]`` iid N(0, 1) entries: rows w_i ~ N(0, I_d) (Luo Eqs. 4-5)."""
  _check_sizes(num_features, dim)
  return jax.random.normal(key, (num_features, dim), dtype)


@functools.partial(jax.jit, static_argnames=("num_features", "dim", "dtype"))
def orthogonal_projection(key, num_features: int, dim: int, *, dtype=jnp.float32):
  """``[num_features, dim]`` orthogonal random features (Performer ORF).

  Rows come in blocks of ``dim`` exactly orthogonal directions (Q of the QR of a Gaussian
  matrix, columns sign-corrected by sign(diag R) so Q is Haar-distributed); each row is then
  rescaled by an independent chi(dim) norm (the norm of an iid Gaussian d-vector), so every row
  is marginally N(0, I_d) and PRF / TRF stay unbiased. ``num_features`` need not be a multiple
  of ``dim``: the last block is truncated.
  """
  _check_sizes(num_features, dim)
  work = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
  n_blocks = -(-num_features // dim)
  key_dir, key_norm = jax.random.split(key)
  q, r = jnp.linalg.qr(jax.random.normal(key_dir, (n_blocks, dim, dim), work))
  q = q * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[:, None, :]
  rows = jnp.swapaxes(q, -1, -2).reshape(n_blocks * dim, dim)[:num_features]
  gauss = jax.random.normal(key_norm, (num_features, dim), work)
  norms = jnp.sqrt(jnp.sum(gauss * gauss, axis=-1, keepdims=True))
  return (rows * norms).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Random feature maps
# ---------------------------------------------------------------------------------------------
def _project(x, projection):
  """Casts to the compute dtype and returns ``(x, w.x)`` with w.x ``[b, l, h, m]``."""
  dtype = _compute_dtype(x, projection)
  x, w = x.astype(dtype), jnp.asarray(projection).astype(dtype)
  spec = "blhd,md->blhm" if w.ndim == 2 else "blhd,hmd->blhm"
  # HIGHEST: the result is exponentiated, so TF32 / bf16-pass matmul error would be amplified.
  return x, jnp.einsum(spec, x, w, precision=jax.lax.Precision.HIGHEST)


def _prf_exponent(x, projection):
  """w_i.x - |x|^2 / 2, the log of the PRF features up to 1/sqrt(m). ``[b, l, h, m]``."""
  x, wx = _project(x, projection)
  return wx - 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)


@jax.jit
def prf(x, projection):
  """Positive random features (Luo Eq. 5): phi(x) = exp(w_i.x - |x|^2/2) / sqrt(m).

  No stabiliser: the plain estimator, E_w[phi(q).phi(k)] = exp(q.k) for w_i ~ N(0, I).
  x ``[b, l, h, d]``, projection ``[m, d]`` or ``[h, m, d]`` -> ``[b, l, h, m]``.
  """
  _check_x(x)
  _check_projection(projection, x, "prf")
  z = _prf_exponent(x, projection)
  return jnp.exp(z) / math.sqrt(z.shape[-1])


FAVOR_EPS = 1e-6  # what favor (and orf) add after the exponential, by default


@functools.partial(jax.jit, static_argnames=("is_query", "eps", "causal"))
def favor(
    x, projection, *, is_query: bool, mask=None, eps: float = FAVOR_EPS, causal: bool = False
):
  """Performer FAVOR+: PRF (Luo Eq. 5) with the Performer stabiliser, plus eps.

  phi(x) = exp(w_i.x - |x|^2/2 - c) / sqrt(m) + eps, c from ``_stabilizer`` (per token for
  queries; one per (batch, head) for keys: over the real keys, or the first real key's when
  ``causal``), which cancels in attention; eps keeps
  the denominator away from zero. With eps = 0 the attention weights equal those of ``prf``.
  x ``[b, l, h, d]``, projection ``[m, d]`` or ``[h, m, d]``, mask ``[b, l]`` -> ``[b, l, h, m]``.
  """
  _check_x(x)
  _check_projection(projection, x, "favor")
  _check_mask(mask, x)
  z = _prf_exponent(x, projection)
  z = z - _stabilizer(z, is_query=is_query, mask=mask, causal=causal)
  return jnp.exp(z) / math.sqrt(z.shape[-1]) + eps


@jax.jit
def trf(x, projection):
  """Trigonometric random features (Luo Eq. 4):
  phi(x) = exp(|x|^2/2) / sqrt(m) [sin(w_1.x), ..., sin(w_m.x), cos(w_1.x), ..., cos(w_m.x)].

  Unbiased for exp(q.k) but can be negative (and overflows for large |x|).
  x ``[b, l, h, d]``, projection ``[m, d]`` or ``[h, m, d]`` -> ``[b, l, h, 2m]``.
  """
  _check_x(x)
  _check_projection(projection, x, "trf")
  x, wx = _project(x, projection)
  scale = jnp.exp(0.5 * jnp.sum(x * x, axis=-1, keepdims=True)) / math.sqrt(wx.shape[-1])
  return jnp.concatenate([jnp.sin(wx), jnp.cos(wx)], axis=-1) * scale


@functools.partial(jax.jit, static_argnames="eps")
def nprf(x, projection, *, eps: float = 1e-6):
  """Normalised PRF (Luo Sec. 3.3): prf(x / max(|x|, eps)), so q.k lies in [-1, 1] and the
  estimator's variance (Luo Eq. 14) stays bounded. Shapes as ``prf``."""
  _check_x(x)
  _check_projection(projection, x, "nprf")
  x = x.astype(_compute_dtype(x, projection))
  norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
  return prf(x / jnp.maximum(norm, eps), projection)


# ---------------------------------------------------------------------------------------------
# The kernel record: one per kernel, read by everything that needs a fact about a kernel
# ---------------------------------------------------------------------------------------------
# Every option a kernel can take, with its default (the option fields of ``Kernel``); the
# declarations, valid values included, are ``OPTIONS`` (fastpos.ops.kernel_options).
OPTION_DEFAULTS = types.MappingProxyType({k: o.default for k, o in OPTIONS.items()})

# The arguments a feature map may take besides x (``FeatureMap.reads`` names its own).
MAP_ARGUMENTS = ("projection", "is_query", "mask", "nu", "causal")


class Projection(Protocol):
  """How a random map's projection is drawn (``gaussian_projection``, ``orthogonal_projection``)."""

  def __call__(self, key, num_features: int, dim: int, *, dtype=...) -> jax.Array:
    ...


def _same(dim: int, num_features: int | None, nu: int) -> int:
  return dim


def _per_feature(dim: int, num_features: int | None, nu: int) -> int:
  return num_features


def _dpfp_dim(dim: int, num_features: int | None, nu: int) -> int:
  return 2 * dim * nu


def _two_per_feature(dim: int, num_features: int | None, nu: int) -> int:
  return 2 * num_features


def _sikf_exponent(x, projection=None):
  """sikf's exponent: x itself (upcast). ``[b, l, h, d] -> [b, l, h, d]``."""
  del projection
  return _upcast(x)


@dataclasses.dataclass(frozen=True)
class ExpForm:
  """An exponential map's form, ``phi(x) = exp(z - c) * r + eps`` with ``z = exponent(x, w)``
  ``[b, l, h, m]``, ``r = 1/sqrt(m)`` or 1 and ``c`` the stabiliser (0 without one): what lets
  a causal layer and decoding split key features into a bounded part ``exp(z - max z)`` and a
  log scale (``causal_key_parts``, ``fastpos.ops.decoding.key_parts``).

  Attributes:
    exponent: ``exponent(x, projection) -> z``, in the compute dtype.
    normalised: phi carries the 1/sqrt(m) of an average over m random features.
    eps: what phi adds after the exponential (favor's eps; 0 for the others).
    shared_max: keys are stabilised by one max shared by all keys (the first real key's in a
      causal layer, ``_stabilizer``), which decoding must take from the first key it sees;
      False: no stabiliser (``prf``).
  """

  exponent: Callable[..., jax.Array]
  normalised: bool = True
  eps: float = 0.0
  shared_max: bool = True


@dataclasses.dataclass(frozen=True)
class FeatureMap:
  """A feature map phi and its facts, called with named arguments:
  ``phi(x [b, l, h, d], *, projection, is_query, mask, nu, causal) -> [b, l, h, m]``.

  Attributes:
    fn: the map (one of the functions above); a random map takes the projection as its second
      argument, the others by keyword.
    reads: the arguments of ``MAP_ARGUMENTS`` that ``fn`` takes; the others are not passed.
    out_dim: ``out_dim(dim, num_features, nu) -> m``, the size of phi(x) for inputs of size dim.
    options: the names of ``OPTION_DEFAULTS`` the kernel reads.
    projection: how the random projection is drawn; None for the deterministic maps.
    estimates_softmax: phi(q).phi(k) estimates exp(q.k), so the attention layer scales q and k
      by d^-1/4 before phi to estimate softmax's exp(q.k / sqrt(d)).
    nonnegative: phi(x) >= 0 always (what causal kernelized RPE and PermuteFormer need).
    exp_form: the map is an exponential (``ExpForm``), so a causal layer keeps its keys'
      scale apart (``Kernel.scaled_keys``) and, with ``shared_max``, decoding splits its key
      features (``Kernel.stabilised``); None for the other maps.
  """

  fn: Callable[..., jax.Array]
  reads: tuple[str, ...] = ()
  out_dim: Callable[[int, int | None, int], int] = _same
  options: tuple[str, ...] = ("eps",)
  projection: Projection | None = None
  estimates_softmax: bool = False
  nonnegative: bool = True
  exp_form: ExpForm | None = None

  def __post_init__(self):
    unknown = [r for r in self.reads if r not in MAP_ARGUMENTS]
    if unknown:
      raise ValueError(f"FeatureMap reads {unknown}; valid: {', '.join(MAP_ARGUMENTS)}.")

  def __call__(
      self,
      x,
      *,
      projection=None,
      is_query: bool = False,
      mask=None,
      nu: int = 1,
      causal: bool = False,
  ) -> jax.Array:
    given = {"is_query": is_query, "mask": mask, "nu": nu, "causal": causal}
    kwargs = {r: given[r] for r in self.reads if r != "projection"}
    if "projection" in self.reads:
      return self.fn(x, projection, **kwargs)
    return self.fn(x, **kwargs)


_RANDOM_OPTIONS = ("num_features", "eps", "redraw", "seed")
_STABILISED = ("is_query", "mask", "causal")


def _random(fn, *, reads=(), out_dim=_per_feature, **facts) -> FeatureMap:
  return FeatureMap(
      fn,
      reads=("projection",) + reads,
      out_dim=out_dim,
      options=_RANDOM_OPTIONS,
      projection=facts.pop("projection", gaussian_projection),
      **facts,
  )


# Adding a kernel: one entry here (the config's model.kernel takes its choices from KERNELS;
# a new option goes in OPTIONS), and its dense (numpy) check in tests/ops/test_features.py
# (``_NUMPY``); tests/ops/test_kernel_registry.py fails until it has one. softmax has no map:
# it is computed from materialised scores.
_FAVOR_FORM = ExpForm(_prf_exponent, eps=FAVOR_EPS)
_MAPS: dict[str, FeatureMap | None] = {
    "softmax": None,
    "elu1": FeatureMap(elu1),
    "relu": FeatureMap(relu),
    "sikf": FeatureMap(sikf, reads=_STABILISED, exp_form=ExpForm(_sikf_exponent, normalised=False)),
    "dpfp": FeatureMap(dpfp, reads=("nu",), out_dim=_dpfp_dim, options=("nu", "eps")),
    "favor": _random(favor, reads=_STABILISED, estimates_softmax=True, exp_form=_FAVOR_FORM),
    "prf": _random(prf, estimates_softmax=True, exp_form=ExpForm(_prf_exponent, shared_max=False)),
    "trf": _random(trf, out_dim=_two_per_feature, estimates_softmax=True, nonnegative=False),
    # nprf normalises q and k itself (a d^-1/4 scale would cancel), so estimates_softmax=False.
    "nprf": _random(nprf),
    "orf": _random(
        favor,
        reads=_STABILISED,
        projection=orthogonal_projection,
        estimates_softmax=True,
        exp_form=_FAVOR_FORM,
    ),
}
KERNELS = tuple(_MAPS)
FEATURE_MAPS = tuple(n for n, m in _MAPS.items() if m is not None)


@dataclasses.dataclass(frozen=True)
class Kernel:
  """An attention kernel: its name and options, and (as properties) every fact about it.

  The one record of a kernel: the attention layer takes it (``fastpos.models.KernelSpec`` is
  this class), the positional schemes see it (``fastpos.positional.KernelInfo`` is this class,
  in ``Dims.kernel`` and ``Scheme.compatibility``), and the compatibility table and decoding
  read it. The option fields are every kernel's options (``OPTION_DEFAULTS``); each kernel
  reads those its map lists (``options``), so one model config can switch kernels without
  editing its options.

  Attributes:
    name: ``"softmax"`` or a feature map of ``FEATURE_MAPS`` (``model.kernel``).
    num_features: m for the random maps (favor, prf, trf, nprf, orf).
    nu: DPFP's nu.
    eps: the linear-attention denominator guard.
    redraw: redraw the random projection at every training step (Performer); otherwise one
      fixed draw per layer from ``seed`` and the layer's path.
    seed: seed of the fixed projection.

  Example::

      kernel = fastpos.Kernel("favor", num_features=32)   # fastpos.KernelSpec is this class
      kernel.options                                # ('num_features', 'eps', 'redraw', 'seed')
      q = jnp.ones((2, 10, 4, 16))                        # [batch, N, heads, dim] float32
      w = kernel.make_projection(jax.random.key(0), 16)   # [32, 16] random features
      phi = kernel.phi(q, projection=w, is_query=True)    # [2, 10, 4, 32] float32, >= 0
  """

  name: str = "softmax"
  num_features: int = OPTION_DEFAULTS["num_features"]
  nu: int = OPTION_DEFAULTS["nu"]
  eps: float = OPTION_DEFAULTS["eps"]
  redraw: bool = OPTION_DEFAULTS["redraw"]
  seed: int = OPTION_DEFAULTS["seed"]

  def __post_init__(self):
    if self.name not in _MAPS:
      raise ValueError(f"unknown kernel {self.name!r}; valid choices: {', '.join(KERNELS)}.")

  @classmethod
  def from_config(cls, name: str, options: Mapping | None = None) -> "Kernel":
    """Validates ``options`` (``model.kernel_options``) against kernel ``name``.

    An option no kernel takes is an error naming the kernel and its options. Options of other
    kernels are allowed (the shared ``kernel_options`` block holds them all) and unused.
    """
    kernel = cls(name)
    options = dict(options or {})
    for key in options:
      if key not in OPTION_DEFAULTS:
        raise ValueError(_unknown_option(kernel, key))
    return cls(name=name, **options)

  @property
  def map(self) -> FeatureMap | None:
    """The feature map phi; None for ``softmax``."""
    return _MAPS[self.name]

  @property
  def is_softmax(self) -> bool:
    return self.map is None

  @property
  def needs_projection(self) -> bool:
    return self.map is not None and self.map.projection is not None

  @property
  def estimates_softmax(self) -> bool:
    return self.map is not None and self.map.estimates_softmax

  @property
  def nonnegative(self) -> bool:
    """phi(x) >= 0 always (True for softmax, whose exp is positive)."""
    return self.map is None or self.map.nonnegative

  @property
  def scaled_keys(self) -> bool:
    """phi is an exponential (``FeatureMap.exp_form``): a causal layer splits its keys into a
    bounded part and a log scale (``causal_key_parts``) and its scan keeps a running maximum
    of the scale, so a late key far above the first one cannot overflow."""
    return self.map is not None and self.map.exp_form is not None

  @property
  def stabilised(self) -> bool:
    """Its keys share one stabilising max (``ExpForm.shared_max``), which decoding takes from
    the first real key it sees (``fastpos.ops.decoding.key_parts``)."""
    return self.scaled_keys and self.map.exp_form.shared_max

  @property
  def options(self) -> tuple[str, ...]:
    """The names of ``OPTION_DEFAULTS`` this kernel reads."""
    return () if self.map is None else self.map.options

  @property
  def defaults(self) -> dict:
    """The options this kernel reads, with their defaults."""
    return {o: OPTION_DEFAULTS[o] for o in self.options}

  def feature_dim(self, dim: int) -> int:
    """m, the size of phi(x) for inputs of size ``dim`` (``feature_dim``)."""
    return feature_dim(self.name, dim, num_features=self.num_features, nu=self.nu)

  def phi(self, x, *, projection=None, is_query: bool = False, mask=None, causal: bool = False):
    """``feature_map`` of this kernel (its ``nu``): ``[b, l, h, d] -> [b, l, h, m]``."""
    return feature_map(
        self, x, projection=projection, is_query=is_query, mask=mask, nu=self.nu, causal=causal
    )

  def make_projection(self, key, dim: int, *, dtype=jnp.float32):
    """None, or this kernel's ``[num_features, dim]`` random projection (``make_projection``)."""
    return make_projection(self.name, key, self.num_features, dim, dtype=dtype)


def _unknown_option(kernel: Kernel, key: str) -> str:
  own = ", ".join(f"{k}={v!r}" for k, v in kernel.defaults.items()) or "(none)"
  others = ", ".join(o for o in OPTION_DEFAULTS if o not in kernel.options)
  name = kernel.name
  tail = (
      f" (kernel_options may also hold other kernels' options, unused by {name!r}: {others})."
      if others
      else "."
  )
  return f"unknown kernel option {key!r} for kernel {name!r}; {name!r} takes: {own}" + tail


def get_kernel(name: "str | Kernel") -> Kernel:
  """The record of kernel ``name`` with default options (a ``Kernel`` is returned as it is)."""
  return name if isinstance(name, Kernel) else Kernel(name)


def _feature_kernel(name: "str | Kernel") -> Kernel:
  """The record of a feature-map kernel (a name, or a record as it is)."""
  if isinstance(name, Kernel) and not name.is_softmax:
    return name
  name = getattr(name, "name", name)
  if name not in FEATURE_MAPS:
    raise ValueError(f"Unknown feature map {name!r}; valid choices: {', '.join(FEATURE_MAPS)}.")
  return Kernel(name)


def feature_map(
    name: "str | Kernel",
    x,
    *,
    projection=None,
    is_query: bool = False,
    mask=None,
    nu: int = 1,
    causal: bool = False,
):
  """Applies the feature map ``name`` (one of ``FEATURE_MAPS``, or its record) to ``x``.

  ``projection`` is required by the random maps (build it with ``make_projection``) and refused
  by the deterministic ones; ``is_query``, ``mask`` and ``causal`` (keys of a causal layer:
  a stabiliser no later key changes) matter for the stabilised maps (``sikf``, ``favor``,
  ``orf``); ``nu`` for ``dpfp``. Returns ``[b, l, h, feature_dim(...)]``.
  """
  kernel = _feature_kernel(name)
  name = kernel.name
  _check_x(x)
  if kernel.needs_projection:
    _check_projection(projection, x, name)
  elif projection is not None:
    raise ValueError(
        f"feature map {name!r} is deterministic and takes no projection; got one "
        f"of shape {jnp.shape(projection)}."
    )
  return kernel.map(x, projection=projection, is_query=is_query, mask=mask, nu=nu, causal=causal)


def make_projection(name: str, key, num_features: int, dim: int, *, dtype=jnp.float32):
  """The projection kernel ``name`` needs: None (softmax, deterministic maps) or its
  ``[num_features, dim]`` draw (Gaussian for favor, prf, trf, nprf; orthogonal for orf)."""
  kernel = get_kernel(name)
  if not kernel.needs_projection:
    return None
  return kernel.map.projection(key, num_features, dim, dtype=dtype)


def feature_dim(name: str, dim: int, *, num_features: int | None = None, nu: int = 1) -> int:
  """m, the size of phi(x) for inputs of size ``dim`` (``FeatureMap.out_dim``): dim (softmax,
  elu1, relu, sikf), 2 dim nu (dpfp), num_features (favor, prf, nprf, orf) or 2 num_features
  (trf)."""
  kernel = get_kernel(name)
  if "nu" in kernel.options:
    _check_nu(nu, dim)
  if kernel.needs_projection:
    if num_features is None:
      raise ValueError(
          f"feature map {name!r} is random; feature_dim needs num_features, got " "None."
      )
    _check_sizes(num_features, dim)
  return dim if kernel.is_softmax else kernel.map.out_dim(dim, num_features, nu)


def exp_parts(kernel: Kernel, x, projection=None):
  """``(z, e, top)`` of a map with an ``exp_form``: its exponent z ``[b, l, h, m]``, the token's
  max ``top = max_m z`` ``[b, l, h, 1]`` (behind stop_gradient) and the bounded part
  ``e = exp(z - top)`` (over sqrt(m) when ``normalised``): phi(x) = e exp(top - c) + eps."""
  form = kernel.map.exp_form
  if kernel.needs_projection:
    _check_projection(projection, x, kernel.name)
  z = form.exponent(x, projection)
  top = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  e = jnp.exp(z - top)
  if form.normalised:
    e = e / math.sqrt(z.shape[-1])
  return z, e, top


def causal_key_parts(
    name: "str | Kernel", x, *, projection=None, mask=None, nu: int = 1, eps: float | None = None
):
  """The causal keys' features split for ``linear_attention(key_log_scale=, key_eps=)``.

  Returns ``(e [b, l, h, m], log_scale [b, l, h], key_eps)`` with
  ``e * exp(log_scale) + key_eps == feature_map(name, x, causal=True, mask=mask)`` in exact
  arithmetic, where ``e`` is bounded (each token's largest feature is 1, or 1/sqrt(m)) and
  ``log_scale`` carries the rest, for the maps with an ``exp_form`` (``Kernel.scaled_keys``:
  ``sikf``, ``favor``, ``orf``, ``prf``): the token's own max, minus the first real key's
  (the causal stabiliser of ``_stabilizer``) where the keys share one (``shared_max``). The op
  then keeps a running maximum of ``log_scale``, so a late key far larger than the first one
  no longer overflows ``exp``. Other maps: ``log_scale = 0``, ``key_eps = 0``. ``eps``: what
  the map adds after the exponential (None: its own, ``ExpForm.eps``). Scales sit behind
  stop_gradient except through ``e``'s own exponent, so gradients equal those of the features.
  """
  kernel = _feature_kernel(name)
  _check_x(x)
  _check_mask(mask, x)
  form = kernel.map.exp_form
  if form is None:
    e = kernel.map(x, projection=projection, is_query=False, mask=mask, nu=nu, causal=True)
    return e, jnp.zeros(e.shape[:3], e.dtype), 0.0
  z, e, top = exp_parts(kernel, x, projection)
  log_scale = top[..., 0]
  if form.shared_max:
    log_scale = log_scale - _stabilizer(z, is_query=False, mask=mask, causal=True)[..., 0]
  return e, log_scale, (form.eps if eps is None or not form.eps else eps)


def needs_projection(name: str) -> bool:
  """Whether ``name`` is a random-feature map that needs a projection (``make_projection``)."""
  return get_kernel(name).needs_projection


def is_nonnegative(name: str) -> bool:
  """Whether phi(x) >= 0 always: True for every kernel but ``trf`` (sin / cos features)."""
  return get_kernel(name).nonnegative
