"""Array digests: every single-bit change and every swap of two elements changes a digest; the
host and the device compute the same digest for every dtype; the digest does not depend on how
an array is sharded (4 simulated devices, in a subprocess; slow); the JSON digests ignore key order
and formatting but not values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.train import digest as digest_lib

ROOT = Path(__file__).resolve().parents[2]


def _one_bit_flips(x: np.ndarray) -> np.ndarray:
  """``[x.size * 32, *x.shape]``: ``x`` with each of its bits flipped in turn."""
  flipped = np.repeat(x[None], x.size * 32, axis=0)
  bits = flipped.view(np.uint32).reshape(x.size * 32, -1)
  for i in range(x.size * 32):
    bits[i, i // 32] ^= np.uint32(1 << (i % 32))
  return flipped


def _swaps(x: np.ndarray) -> np.ndarray:
  """``x`` with each pair of its elements swapped in turn."""
  flat = x.reshape(-1)
  out = []
  for i in range(flat.size):
    for j in range(i + 1, flat.size):
      y = flat.copy()
      y[[i, j]] = y[[j, i]]
      out.append(y.reshape(x.shape))
  return np.stack(out)


def test_every_single_bit_flip_and_every_swap_changes_the_digest():
  x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
  changed = np.concatenate([_one_bit_flips(x), _swaps(x)])
  # On the host, as array_digests computes small arrays ...
  for method in digest_lib.METHODS:  # SHA-256 of the bytes, and the sum, on the host ...
    mine = digest_lib.array_digests({"x": x}, method)["x"]
    got = digest_lib.array_digests({str(i): c for i, c in enumerate(changed)}, method)
    assert mine not in got.values() and len(set(got.values())) == len(changed)
  want = digest_lib.array_digests({"x": x}, "sum")["x"]
  # ... and on device, as it computes large or sharded ones (one batched call).
  lanes = np.asarray(jax.jit(jax.vmap(digest_lib._device_lanes))(jnp.asarray(changed)))
  intact = np.asarray(jax.jit(digest_lib._device_lanes)(jnp.asarray(x)))
  assert want.endswith(f"{int(intact[0]):08x}{int(intact[1]):08x}")
  assert not np.any(np.all(lanes == intact, axis=1))
  assert len({tuple(r) for r in lanes.tolist()}) == len(changed)


def test_host_and_device_agree_for_every_dtype(monkeypatch):
  rng = np.random.default_rng(1)
  tree = {
      "f32": rng.normal(size=(3, 5)).astype(np.float32),
      "bf16": jnp.asarray(rng.normal(size=(7,)), jnp.bfloat16),
      "f16": rng.normal(size=(2, 2)).astype(np.float16),
      "i8": np.arange(-5, 6, dtype=np.int8),
      "u8": np.arange(9, dtype=np.uint8),
      "i32": np.int32(7),
      "bool": np.array([True, False, True]),
      "key": jax.random.key(3),
      "empty": np.zeros((0, 4), np.float32),
  }
  host = digest_lib.array_digests(tree, "sum")
  monkeypatch.setattr(digest_lib, "HOST_MAX_ELEMENTS", -1)
  assert digest_lib.array_digests(tree, "sum") == host
  assert host["f32"].startswith("float32[3,5]:") and host["key"].startswith("uint32[]:")
  # 64-bit and complex arrays are digested on device.
  wide = {"f64": np.linspace(0, 1, 5), "c64": np.ones(3, np.complex64)}
  for method in digest_lib.METHODS:
    out = digest_lib.array_digests(wide, method)
    f64 = {"f64": np.linspace(0, 1, 5) + 1e-16}
    assert out["f64"] != digest_lib.array_digests(f64, method)["f64"]
    c64 = {"c64": np.ones(3, np.complex64) * 1j}
    assert out["c64"] != digest_lib.array_digests(c64, method)["c64"]
  # Where arrays live in host memory their bytes are hashed, by SHA-256.
  auto = digest_lib.array_digests(tree)
  assert auto.keys() == host.keys()
  assert all(v.split(":")[1] == "sha256" and len(v.split(":")[2]) == 32 for v in auto.values())
  assert auto["bf16"].startswith("bfloat16[7]:") and auto["key"].startswith("uint32[]:")


@pytest.mark.parametrize("method", digest_lib.METHODS)
def test_check_arrays_names_what_differs(method):
  tree = {"a": np.zeros(3, np.float32), "b": np.ones((2, 2), np.float32)}
  rec = digest_lib.array_digests(tree, method)
  digest_lib.check_arrays(rec, tree)
  with pytest.raises(digest_lib.DigestMismatch, match=r"1 of 2 arrays differ.*: b$"):
    digest_lib.check_arrays(rec, {**tree, "b": np.full((2, 2), 2, np.float32)})
  with pytest.raises(digest_lib.DigestMismatch, match=r"b \(float32\[2,2\] -> float32\[4\]\)"):
    digest_lib.check_arrays(rec, {**tree, "b": np.ones(4, np.float32)})
  with pytest.raises(digest_lib.DigestMismatch, match=r"b \(missing\)"):
    digest_lib.check_arrays(rec, {"a": tree["a"]})


def test_each_entry_is_checked_by_the_method_it_names(monkeypatch):
  tree = {"a": np.arange(5, dtype=np.float32), "b": jnp.ones((300, 300), jnp.float32)}
  # Format 1 (sums) and format 2 entries, mixed in one record, both verify ...
  mixed = {
      "a": digest_lib.array_digests(tree)["a"],
      "b": digest_lib.array_digests(tree, "sum")["b"],
  }
  digest_lib.check_arrays(mixed, tree)
  # ... as do byte digests where the arrays are not in host memory (here: said not to be).
  auto = digest_lib.array_digests(tree)
  monkeypatch.setattr(digest_lib, "BYTE_HASH_PLATFORMS", frozenset())
  assert digest_lib.array_digests(tree)["b"] == digest_lib.array_digests(tree, "sum")["b"]
  digest_lib.check_arrays(auto, tree)
  with pytest.raises(digest_lib.DigestMismatch, match=r"1 of 2 arrays differ.*: b$"):
    digest_lib.check_arrays(auto, {**tree, "b": tree["b"].at[299, 0].set(2.0)})
  with pytest.raises(ValueError, match="method='bytes'; valid choices: auto, sum"):
    digest_lib.array_digests(tree, "bytes")


def test_meta_digest_checks_values_not_formatting():
  meta = {
      "rng": [1, 2],
      "config": {"model": {"x": 1e-6}},
      "step": 4,
      "data": None,
      "log_window": None,
  }
  meta["digests"] = {"format": 2, "arrays": {}, "meta": digest_lib.meta_digest(meta)}
  assert digest_lib.check_meta(dict(reversed(list(meta.items())))) == meta["digests"]
  with pytest.raises(digest_lib.DigestMismatch, match="differs from its digest"):
    digest_lib.check_meta({**meta, "rng": [1, 3]})
  legacy = {k: v for k, v in meta.items() if k != "digests"}
  assert digest_lib.check_meta(legacy) is None
  with pytest.raises(digest_lib.DigestMismatch, match="no digest record but unknown fields"):
    digest_lib.check_meta({**legacy, "digesus": meta["digests"]})


_SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from fastpos.train import digest
assert jax.device_count() == 4
x = np.random.default_rng(0).normal(size=(8, 300, 40)).astype(np.float32)  # > host limit
mesh = jax.make_mesh((2, 2), ("a", "b"))
ways = [jnp.asarray(x)] + [jax.device_put(x, NamedSharding(mesh, spec)) for spec in
                           (P("a", None, "b"), P(None, ("a", "b")))]
for m in digest.METHODS:
  print("DIGESTS", m, sorted({digest.array_digests({"x": w}, m)["x"] for w in ways}))
"""


@pytest.mark.slow  # a subprocess with 4 simulated devices: ~10 s
def test_the_digest_does_not_depend_on_the_sharding():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", PYTHONPATH=str(ROOT))
  env.pop("JAX_PLATFORMS", None)
  proc = subprocess.run(
      [sys.executable, "-c", _SHARDED],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [l for l in proc.stdout.splitlines() if l.startswith("DIGESTS")]
  x = np.random.default_rng(0).normal(size=(8, 300, 40)).astype(np.float32)
  assert lines == [
      f"DIGESTS {m} {[digest_lib.array_digests({'x': x}, m)['x']]}" for m in digest_lib.METHODS
  ]
