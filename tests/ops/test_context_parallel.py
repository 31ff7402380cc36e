"""The context-parallel ops (``fastpos.ops.context_parallel``) equal their unsplit ops.

4 simulated CPU devices (2 or 3 of them for some cases: device counts that are not a power of
two, a ring of two) in one subprocess, since the device count is fixed when JAX starts: it
runs every case and prints the worst relative error of the output and of every gradient
(float64, held to 1e-9; the float32 case to 1e-4 against the float64 product).

The ring Toeplitz product's cases cover its layouts (``[..., n, C]``, ``[b, n, h, d]`` with
``seq_axis=1``, an x broadcast against the table's leading dims) and its grouping (the whole
batch in one group, a few items per group, channel chunks of one item: the group size set by
``toeplitz._GROUP_BYTES`` in complex rows of the FFT).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_on_devices

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-9
TOL_FLOAT32 = 1e-4

# (name, devices, op, options). op "toeplitz": the ring product; "scan": exclusive_scan;
# "linear": linear_attention with the options causal / rpe / decay / den / mask / chunk.
CASES = [
    ("toeplitz_causal", 4, "toeplitz", {"causal": True}),
    (
        "linear_causal_rpe_decay",
        4,
        "linear",
        {"causal": True, "rpe": True, "decay": True, "mask": True},
    ),
]
# Under -m slow; the default run keeps the ring Toeplitz product (toeplitz_causal) and the
# linear attention with every causal option (linear_causal_rpe_decay) split over 4 devices.
SLOW_CASES = [
    ("toeplitz_heads_p3", 3, "toeplitz", {"layout": "heads"}),
    ("toeplitz_causal_chunks_p2", 2, "toeplitz", {"causal": True, "rows": 1, "block": 16}),
    ("toeplitz_broadcast_groups", 4, "toeplitz", {"layout": "broadcast", "rows": 6}),
    ("scan_decay_p3", 3, "scan", {"decay": True}),
    ("linear", 4, "linear", {"mask": True}),
    (
        "linear_causal_decay_den",
        4,
        "linear",
        {"causal": True, "decay": True, "den": True, "mask": True},
    ),
    ("toeplitz", 4, "toeplitz", {}),
    ("linear_rpe_den", 4, "linear", {"rpe": True, "den": True, "mask": True}),
    ("toeplitz_p2", 2, "toeplitz", {"causal": True}),
    ("toeplitz_causal_heads_p3", 3, "toeplitz", {"causal": True, "layout": "heads", "rows": 2}),
    ("toeplitz_causal_float32", 4, "toeplitz", {"causal": True, "float32": True, "block": 64}),
    ("scan_p4", 4, "scan", {}),
    ("linear_den", 4, "linear", {"den": True}),
    ("linear_causal", 4, "linear", {"causal": True, "mask": True}),
    ("linear_causal_p3", 3, "linear", {"causal": True, "decay": True}),
    ("linear_rpe", 4, "linear", {"rpe": True}),
    (
        "linear_causal_rpe_den",
        4,
        "linear",
        {"causal": True, "rpe": True, "den": True, "mask": True},
    ),
]


def run_cases(cases) -> dict[str, dict[str, float]]:
  """Runs in the subprocess: {case: {"out": rel err, "grad <arg>": rel err, ...}}."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  from fastpos.ops import attention, toeplitz
  from fastpos.ops import context_parallel as cp

  def one_case(devices, op, opts):
    rng = np.random.default_rng(0)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("seq",))
    block = opts.get("block", 8)  # positions per device (chunk 3: a partial chunk per block)
    n = block * devices
    causal = opts.get("causal", False)
    split = P(None, "seq")
    if op == "toeplitz":
      args, specs, out_spec, full, local = toeplitz_case(rng, n, causal, opts.get("layout"))
    elif op == "scan":
      args = {"x": rng.normal(size=(devices, 3, 4))}  # [P, heads, .]: one row each
      decay = jnp.asarray([-0.2, -0.05, 0.0]) if opts.get("decay") else None
      block = 5
      specs, out_spec = {"x": P("seq")}, P("seq")

      def full(a):  # sum_{q<p} r^((p-1-q) block) x_q, densely
        p = np.arange(devices)
        hops = (p[:, None] - 1 - p[None, :]).astype(float)
        logw = 0.0 if decay is None else decay[None, None, :] * (hops * block)[..., None]
        weight = jnp.where((hops >= 0)[..., None], jnp.exp(logw), 0.0)  # [P, Q, h]
        return jnp.einsum("pqh,qhc->phc", weight, a["x"])

      local = lambda a: cp.exclusive_scan(a["x"], axis_name="seq", log_decay=decay, block=block)
    else:
      b, h, m, d = 2, 2, 3, 4
      args = {
          "q": rng.uniform(0.1, 1.0, (b, n, h, m)),
          "k": rng.uniform(0.1, 1.0, (b, n, h, m)),
          "v": rng.normal(size=(b, n, h, d)),
      }
      specs = {"q": split, "k": split, "v": split}
      if opts.get("rpe"):
        args["rpe"] = np.exp(0.3 * rng.normal(size=(h, 2 * n - 1)))
        specs["rpe"] = P()
      if opts.get("decay"):
        args["decay"] = np.array([-0.1, -0.4])
        specs["decay"] = P()
      if opts.get("den"):
        args["den_q"] = rng.uniform(0.1, 1.0, (b, n, h, 2))
        args["den_k"] = rng.uniform(0.1, 1.0, (b, n, h, 2))
        specs.update(den_q=split, den_k=split)
      mask = None
      if opts.get("mask"):
        mask = jnp.asarray(np.arange(n)[None] < np.array([[n], [n - 5]]))
      out_spec = split

      def kw(a, m):
        den = (a["den_q"], a["den_k"]) if "den_q" in a else None
        return dict(
            mask=m,
            causal=causal,
            rpe=a.get("rpe"),
            decay=a.get("decay"),
            den_features=den,
            chunk_size=3,
        )

      full = lambda a: attention.linear_attention(a["q"], a["k"], a["v"], **kw(a, mask))
      if mask is None:
        local = lambda a: cp.linear_attention(
            a["q"], a["k"], a["v"], axis_name="seq", **kw(a, None)
        )
      else:
        args["mask"] = np.asarray(mask)
        specs["mask"] = split
        local = lambda a: cp.linear_attention(
            a["q"], a["k"], a["v"], axis_name="seq", **kw(a, a["mask"])
        )
    return compare(mesh, args, specs, out_spec, full, local, opts.get("float32", False))

  def with_groups(devices, op, opts):  # "rows": complex FFT rows per group of the ring
    if "rows" not in opts:
      return one_case(devices, op, opts)
    saved = toeplitz._GROUP_BYTES
    fft_len = toeplitz.fft_size(2 * opts.get("block", 8) - 1)
    toeplitz._GROUP_BYTES = opts["rows"] * fft_len * 16  # complex128
    try:
      return one_case(devices, op, opts)
    finally:
      toeplitz._GROUP_BYTES = saved

  return {name: with_groups(devices, op, opts) for name, devices, op, opts in cases}


def compare(mesh, args, specs, out_spec, full, local, float32: bool) -> dict[str, float]:
  """Relative errors of the split op (``local`` in ``shard_map``) against ``full``: the
  output and the gradient of every input but the mask, for a random cotangent. float32: the
  split op takes the inputs in float32, held against the float64 op of the same values."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  def rel(a, r):
    return float(jnp.max(jnp.abs(a - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-300))

  if float32:
    args = {k: np.asarray(v, np.float32).astype(np.float64) for k, v in args.items()}
  args = {k: jnp.asarray(v) for k, v in args.items()}
  own = {k: v.astype(jnp.float32) for k, v in args.items()} if float32 else args
  sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=out_spec))
  ref = full(args)
  errs = {"out": rel(sharded(own), ref)}
  cot = jnp.asarray(np.random.default_rng(1).normal(size=ref.shape))
  wrt = [k for k in args if k != "mask"]

  def loss(fn, diff, base):
    return jnp.sum(fn({**base, **diff}) * cot.astype(next(iter(diff.values())).dtype))

  got = jax.jit(jax.grad(lambda dd: loss(sharded, dd, own)))({k: own[k] for k in wrt})
  want = jax.grad(lambda dd: loss(full, dd, args))({k: args[k] for k in wrt})
  errs.update({f"grad {k}": rel(got[k], want[k]) for k in wrt})
  return errs


def toeplitz_case(rng, n: int, causal: bool, layout: str | None):
  """(args, in specs, out spec, unsplit fn, split fn) of a ring Toeplitz product case.

  layout None: w ``[2, 2N-1]``, x ``[3, 2, n, 5]``; "heads": x ``[b, n, h, c]`` with
  ``seq_axis=1`` and one table per head; "broadcast": x ``[3, n, 6]`` against w
  ``[2, 3, 2N-1]`` (the output ``[2, 3, n, 6]``; x's gradient sums over the 2 tables)."""
  from jax.sharding import PartitionSpec as P

  from fastpos.ops import context_parallel as cp
  from fastpos.ops import toeplitz

  table = 2 * n - 1
  if layout == "heads":
    args = {"w": rng.normal(size=(3, table)), "x": rng.normal(size=(2, n, 3, 6))}
    specs, out_spec = {"w": P(), "x": P(None, "seq")}, P(None, "seq")

    def full(a):
      y = toeplitz.toeplitz_matmul(a["w"], a["x"].transpose(0, 2, 1, 3), causal=causal)
      return y.transpose(0, 2, 1, 3)

    def local(a):
      return cp.toeplitz_matmul(a["w"], a["x"], axis_name="seq", causal=causal, seq_axis=1)

    return args, specs, out_spec, full, local
  if layout == "broadcast":
    args = {"w": rng.normal(size=(2, 3, table)), "x": rng.normal(size=(3, n, 6))}
    specs, out_spec = {"w": P(), "x": P(None, "seq")}, P(None, None, "seq")
  else:
    args = {"w": rng.normal(size=(2, table)), "x": rng.normal(size=(3, 2, n, 5))}
    specs, out_spec = {"w": P(), "x": P(None, None, "seq")}, P(None, None, "seq")
  full = lambda a: toeplitz.toeplitz_matmul(a["w"], a["x"], causal=causal)
  local = lambda a: cp.toeplitz_matmul(a["w"], a["x"], axis_name="seq", causal=causal)
  return args, specs, out_spec, full, local


_SCRIPT = """
import json, sys
import jax
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
from tests.ops.test_context_parallel import CASES, SLOW_CASES, run_cases
names = set(sys.argv[1].split(","))
cases = [c for c in CASES + SLOW_CASES if c[0] in names]
print("RESULT" + json.dumps(run_cases(cases)))
"""


def _run(cases) -> dict:
  return run_on_devices(_SCRIPT, ",".join(c[0] for c in cases))


@pytest.fixture(scope="module")
def results():
  return _run(CASES)


def _tol(case: str) -> float:
  (opts,) = [c[3] for c in CASES + SLOW_CASES if c[0] == case]
  return TOL_FLOAT32 if opts.get("float32") else TOL


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_split_equals_unsplit(results, case):
  errs = results[case]
  assert len(errs) >= 2  # the output and at least one gradient
  bad = {k: e for k, e in errs.items() if not e < _tol(case)}
  assert not bad, f"{case}: relative errors above {_tol(case)}: {bad}"


@pytest.mark.slow
def test_split_equals_unsplit_more_cases():
  res = _run(SLOW_CASES)
  bad = {(case, k): e for case, errs in res.items() for k, e in errs.items() if not e < _tol(case)}
  assert len(res) == len(SLOW_CASES) and not bad, bad


def test_a_table_of_the_wrong_length_names_the_global_length():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  from fastpos.ops import context_parallel as cp

  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
  f = jax.shard_map(
      lambda w, x: cp.toeplitz_matmul(w, x, axis_name="seq"),
      mesh=mesh,
      in_specs=(P(), P(None, "seq")),
      out_specs=P(None, "seq"),
  )
  with pytest.raises(ValueError, match=r"N = 8 x 1 devices = 8 needs 2N-1 = 15 \(the global"):
    f(jnp.ones((2, 7)), jnp.ones((2, 8, 3)))


def test_a_bad_seq_axis_names_the_valid_axes():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  from fastpos.ops import context_parallel as cp

  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
  f = jax.shard_map(
      lambda w, x: cp.toeplitz_matmul(w, x, axis_name="seq", seq_axis=2),
      mesh=mesh,
      in_specs=(P(), P(None, "seq")),
      out_specs=P(None, "seq"),
  )
  with pytest.raises(ValueError, match=r"seq_axis=2 is not an axis .* valid: -3 \.\. 1"):
    f(jnp.ones((2, 15)), jnp.ones((2, 8, 3)))
