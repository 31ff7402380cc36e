"""Digests that let a checkpoint prove its contents (orbax's array chunks carry no checksum).

At save, ``record(state, data_iter, meta)`` gives the ``digests`` block that goes into the
checkpoint's ``meta`` (written in the same orbax commit as the arrays, so it is atomic with
them)::

  {"format": 1,
   "arrays": {"params/embed/embedding": "float32[16,32]:<16 hex>", ...},  # every state leaf
   "data": ["<sha256 of process 0's iterator state>", ...],  # one per process; latest/ only
   "meta": "<sha256 of the rest of meta>"}                   # step, RNG key, data position...

An array's digest is exact over its bits, by one of two methods, each entry naming its own:

* ``"dtype[shape]:sha256:<32 hex>"`` (format 2): SHA-256 of the array's bytes in row-major
  order, truncated to 128 bits. Used where the whole array already sits in this process's host
  memory (the CPU backend, ``BYTE_HASH_PLATFORMS``): no copy, and the CPU's SHA instructions
  hash about 1 GB/s, several times faster than the reduction below on the same cores.
* ``"dtype[shape]:<16 hex>"`` (format 1, and on accelerators, or for an array split over
  processes): each element's bits (bitcast to uint32 words) go through a position-keyed
  bijective mix (murmur3's finalizer of ``bits ^ key(index)``) and the results are summed
  modulo 2**32, twice with independent keys (64 bits). Changing any one element always changes
  the digest (a bijection never maps two values alike, and the sum changes by a non-zero
  amount); two or more changed elements escape with probability about 2**-64. The sum is
  associative and commutative, so it runs where the array lives (one jitted reduction over the
  whole state, no host copy) and is the same however the array is sharded.

Both are independent of the sharding: a checkpoint restored on another mesh verifies (an entry
whose array is now split over processes is gathered first). The data-iterator states and the
metadata are small JSON values: SHA-256 of their canonical JSON text.

``check_meta`` / ``check_arrays`` / ``check_data`` raise ``DigestMismatch`` naming what differs.
This guards against damage (bit rot, torn copies, a stray edit), not against someone who edits
a checkpoint and its digests together.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils

from fastpos.train.sharding import leaf_name

FORMAT = 2  # 1: every array by the position-keyed sum; 2: by SHA-256 of its bytes where local
FORMATS = (1, 2)  # what check_meta reads
# Every key a checkpoint's meta held before digests were recorded: a meta without a digest
# record and with another key is damaged (e.g. a flipped byte in the name "digests").
LEGACY_META_KEYS = frozenset({"rng", "config", "step", "data", "log_window", "metrics"})
_SEEDS = (0x9E3779B9, 0x7F4A7C15)  # one per 32-bit lane of an array digest
# Arrays up to this many elements are hashed on the host: no compilation, microseconds each.
HOST_MAX_ELEMENTS = 1 << 16
# Platforms whose arrays live in host memory: their bytes are hashed in place (SHA-256).
BYTE_HASH_PLATFORMS = frozenset({"cpu"})
SHA256 = "sha256"
METHODS = ("auto", "sum")  # array_digests: bytes where local, else the sum; the sum alone


class DigestMismatch(ValueError):
  """A checkpoint's contents differ from the digests recorded when it was saved."""


# Arrays.
def _fmix32(h):
  """murmur3's 32-bit finalizer: a bijection of uint32 that mixes every bit into every bit
  (numpy or jax uint32 arrays; products wrap modulo 2**32 in both)."""
  c1, c2 = h.dtype.type(0x85EBCA6B), h.dtype.type(0xC2B2AE35)
  h = h ^ (h >> 16)
  h = h * c1
  h = h ^ (h >> 13)
  h = h * c2
  return h ^ (h >> 16)


def _lanes(w, index, xp) -> list:
  """The two uint32 lanes of words ``w`` at row-major positions ``index`` (same shape)."""
  lanes = []
  for seed in _SEEDS:
    key = _fmix32(index * w.dtype.type(0x61C88647) + w.dtype.type(seed))
    lanes.append(xp.sum(_fmix32(w ^ key), dtype=xp.uint32))
  return lanes


def _device_words(x: jax.Array) -> jax.Array:
  """The bits of ``x`` as uint32 words (one per element; two, on a new last axis, for 64-bit
  types; real and imaginary parts for complex types)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return _device_words(jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1))
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size == 4:
    return lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    unsigned = jnp.uint8 if size == 1 else jnp.uint16
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  if size == 8:
    return lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
  raise TypeError(f"cannot digest an array of dtype {x.dtype}")


def _device_lanes(x: jax.Array) -> jax.Array:
  """uint32 ``[2]``: the lanes of ``x`` computed where it lives (keeps its sharding: the
  position comes from per-axis iotas, no reshape)."""
  w = _device_words(x)
  index = jnp.zeros(w.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(w.ndim)):
    index = index + lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride % 2**32)
    stride *= w.shape[axis]
  return jnp.stack(_lanes(w, index, jnp))


def _all_device_lanes(leaves: list[jax.Array]) -> jax.Array:
  return jnp.stack([_device_lanes(x) for x in leaves])


@functools.lru_cache(maxsize=8)
def _device_fn(out_sharding):
  return jax.jit(_all_device_lanes, out_shardings=out_sharding)


def _host_words(x) -> np.ndarray | None:
  """``_device_words`` of a small, fully addressable array, flattened, on the host; None for
  an array the device computes (large, sharded over processes, 64-bit or complex)."""
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if int(np.prod(x.shape)) > HOST_MAX_ELEMENTS or (
      isinstance(x, jax.Array) and not x.is_fully_addressable
  ):
    return None
  dtype = np.dtype(x.dtype)
  if dtype.kind == "c" or dtype.itemsize not in (1, 2, 4):
    return None
  a = np.ascontiguousarray(np.asarray(x)).reshape(-1)
  if dtype == np.bool_:
    return a.astype(np.uint32)
  unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[dtype.itemsize]
  return a.view(unsigned).astype(np.uint32)


@functools.lru_cache(maxsize=32)
def _host_keys(n: int) -> tuple[np.ndarray, ...]:
  """The position keys of ``_lanes`` for ``n`` words, one per lane (kept: the many arrays of
  a state share a few sizes)."""
  index = np.arange(n, dtype=np.uint32)
  keys = tuple(_fmix32(index * np.uint32(0x61C88647) + np.uint32(seed)) for seed in _SEEDS)
  for k in keys:
    k.flags.writeable = False
  return keys


def _host_lanes(w: np.ndarray) -> list:
  """``_lanes`` of flat words on the host, with the cached position keys."""
  return [np.sum(_fmix32(w ^ key), dtype=np.uint32) for key in _host_keys(w.size)]


def _replicated_like(leaves: list[Any]):
  """A replicated sharding on the mesh of the first sharded leaf (so that every process can
  read the digests of arrays it holds only parts of), or None."""
  for x in leaves:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  return None


def _describe(x) -> str:
  dtype = (
      jax.random.key_data(x).dtype
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
      else x.dtype
  )
  return f"{np.dtype(dtype).name}[{','.join(str(d) for d in x.shape)}]"


def _local_value(x) -> np.ndarray | None:
  """The whole of ``x`` as a numpy view of host memory (no device transfer), or None: on an
  accelerator, or split over processes."""
  if isinstance(x, (np.ndarray, np.generic)):
    return np.asarray(x)
  if not isinstance(x, jax.Array):
    return None
  if any(d.platform not in BYTE_HASH_PLATFORMS for d in x.sharding.device_set):
    return None
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.is_fully_addressable:
    return np.asarray(x)
  whole = [s.data for s in x.addressable_shards if s.data.shape == x.shape]  # replicated
  return np.asarray(whole[0]) if whole else None


def _byte_digest(a: np.ndarray) -> str:
  """SHA-256 of ``a``'s row-major bytes, 128 bits (hashlib reads the buffer in place)."""
  a = np.ascontiguousarray(a)
  return f"{SHA256}:{hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest()[:32]}"


def _whole_on_host(x) -> np.ndarray:
  """``x`` gathered whole on this host (every process must call this for the same array)."""
  value = _local_value(x)
  if value is not None:
    return value
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def array_digests(tree: Any, method: str = "auto") -> dict[str, str]:
  """``{leaf name: "dtype[shape]:<digest>"}`` for every array leaf of ``tree`` (a
  ``TrainState`` or the nested dicts a checkpoint restores to). ``method="auto"``: SHA-256 of
  the bytes of each leaf held whole in host memory, the position-keyed sum for the others;
  ``"sum"``: the sum for every leaf (module docstring). The sum runs on the host for leaves of
  at most ``HOST_MAX_ELEMENTS`` elements (nothing to compile), else in one jitted call on
  device; the two give the same digests. Blocks until done."""
  if method not in METHODS:
    raise ValueError(f"method={method!r}; valid choices: {', '.join(METHODS)}.")
  named = [(leaf_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
  local = [_local_value(x) if method == "auto" else None for _, x in named]
  out = {
      name: f"{_describe(x)}:{_byte_digest(v)}"
      for (name, x), v in zip(named, local)
      if v is not None
  }
  rest = [(name, x) for (name, x), v in zip(named, local) if v is None]
  return out | _sum_digests(rest) if rest else out


def _sum_digests(named: list[tuple[str, Any]]) -> dict[str, str]:
  """The position-keyed sum digest of each ``(name, array)``."""
  host = jax.device_get([w for w in (_host_words(x) for _, x in named)])
  on_device = [i for i, w in enumerate(host) if w is None]
  device_lanes = []
  if on_device:
    leaves = [named[i][1] for i in on_device]
    leaves = [jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x for x in leaves]
    device_lanes = np.asarray(jax.device_get(_device_fn(_replicated_like(leaves))(leaves)))
  out, device_row = {}, iter(device_lanes)
  for (name, x), w in zip(named, host):
    if w is not None:
      a, b = _host_lanes(w)
    else:
      a, b = next(device_row)
    out[name] = f"{_describe(x)}:{int(a):08x}{int(b):08x}"
  return out


def _digests_as_recorded(recorded: dict[str, str], tree: Any) -> dict[str, str]:
  """The digest of every array of ``tree`` by the method its ``recorded`` entry names (an
  array that entry digests by its bytes but this process holds only part of is gathered)."""
  named = [(leaf_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
  by_bytes = {n for n, entry in recorded.items() if entry.split(":")[1:2] == [SHA256]}
  out = {n: f"{_describe(x)}:{_byte_digest(_whole_on_host(x))}" for n, x in named if n in by_bytes}
  sums = [(n, x) for n, x in named if n not in by_bytes and n in recorded]
  unknown = {n: x for n, x in named if n not in recorded}
  return out | (_sum_digests(sums) if sums else {}) | array_digests(unknown)


def check_arrays(recorded: dict[str, str], tree: Any) -> None:
  """Raises DigestMismatch naming every array of ``tree`` whose digest differs from
  ``recorded`` (and arrays recorded but missing, or present but not recorded)."""
  now = _digests_as_recorded(recorded, tree)
  bad = sorted(k for k in set(recorded) | set(now) if recorded.get(k) != now.get(k))
  if bad:
    shown = ", ".join(_difference(k, recorded.get(k), now.get(k)) for k in bad[:5])
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise DigestMismatch(
        f"{len(bad)} of {len(now)} arrays differ from their digests: " f"{shown}{more}"
    )


def _difference(name: str, recorded: str | None, now: str | None) -> str:
  if recorded is None:
    return f"{name} (not recorded)"
  if now is None:
    return f"{name} (missing)"
  shape_then, shape_now = recorded.split(":")[0], now.split(":")[0]
  return name if shape_then == shape_now else f"{name} ({shape_then} -> {shape_now})"


# JSON values: the metadata and the data iterators' states.
def json_digest(value: Any) -> str:
  """SHA-256 of ``value``'s canonical JSON text (sorted keys, no spaces)."""
  text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)
  return hashlib.sha256(text.encode()).hexdigest()


def meta_digest(meta: dict[str, Any]) -> str:
  """The digest of a checkpoint's meta without its digest record, as it reads back from
  JSON (tuples become lists)."""
  rest = {k: v for k, v in meta.items() if k != "digests"}
  return json_digest(json.loads(json.dumps(rest, allow_nan=True)))


def data_digests(data_iter) -> list[str] | None:
  """The digest of every process's data-iterator state, in process order (an all-gather
  with several processes); None without an iterator."""
  if data_iter is None:
    return None
  mine = json_digest(data_iter.get_state())
  if jax.process_count() == 1:
    return [mine]
  raw = np.frombuffer(bytes.fromhex(mine), np.uint8)
  every = np.asarray(multihost_utils.process_allgather(raw)).reshape(-1, raw.size)
  return [bytes(row.astype(np.uint8)).hex() for row in every]


def record(
    state: Any, data_iter, meta: dict[str, Any], arrays: dict[str, str] | None = None
) -> dict[str, Any]:
  """The digest block of a checkpoint of ``state``, ``data_iter`` (None: not saved) and
  ``meta``. ``arrays``: the state's ``array_digests`` when already computed."""
  out = {
      "format": FORMAT,
      "arrays": arrays if arrays is not None else array_digests(state),
      "meta": meta_digest(meta),
  }
  data = data_digests(data_iter)
  if data is not None:
    out["data"] = data
  return out


# Checking.
def check_meta(meta: dict[str, Any]) -> dict[str, Any] | None:
  """The digest record of a checkpoint's ``meta``, after checking the rest of ``meta``
  against it; None for a checkpoint written before digests were recorded. Raises
  DigestMismatch when the record is malformed or the meta differs from it."""
  rec = meta.get("digests")
  if rec is None:
    extra = sorted(set(meta) - LEGACY_META_KEYS)
    if extra:
      raise DigestMismatch(f"meta has no digest record but unknown fields {extra}")
    return None
  if (
      not isinstance(rec, dict)
      or rec.get("format") not in FORMATS
      or not isinstance(rec.get("arrays"), dict)
      or not isinstance(rec.get("meta"), str)
      or not isinstance(rec.get("data", []), list)
  ):
    raise DigestMismatch(f"the digest record is malformed: {str(rec)[:100]}")
  if meta_digest(meta) != rec["meta"]:
    raise DigestMismatch("meta (step, RNG key, data position, config) differs from its digest")
  return rec


def check_data(rec: dict[str, Any], data_dir: Path) -> None:
  """Checks this process's data-iterator state file in ``data_dir`` (grain's
  ``process_<i>-of-<n>.json``) against the record."""
  recorded = rec.get("data")
  i, n = jax.process_index(), jax.process_count()
  if recorded is None:
    raise DigestMismatch("the digest record has no data-iterator digests")
  if len(recorded) != n:
    raise DigestMismatch(
        f"the digest record has data-iterator digests of {len(recorded)} " f"processes; {n} now"
    )
  path = data_dir / f"process_{i}-of-{n}.json"
  try:
    state = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise DigestMismatch(f"cannot read the data-iterator state {path.name} ({e})") from None
  if json_digest(state) != recorded[i]:
    raise DigestMismatch(f"the data-iterator state {path.name} differs from its digest")
