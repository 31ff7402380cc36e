"""The context-parallel ops (``fastpos.ops.context_parallel``) equal their unsplit ops.

4 simulated CPU devices (3 for a scan over a device count that is not a power of two) in one
subprocess, since the device count is fixed when JAX starts: it runs every case and prints
the worst relative error of the output and of every gradient (float64, held to 1e-9).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_on_devices

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-9

# (name, devices, op, options). op "toeplitz": the ring product; "scan": exclusive_scan;
# "linear": linear_attention with the options causal / rpe / decay / den / mask / chunk.
CASES = [
    ("toeplitz_causal", 4, "toeplitz", {"causal": True}),
    ("scan_decay_p3", 3, "scan", {"decay": True}),
    ("linear", 4, "linear", {"mask": True}),
    (
        "linear_causal_decay_den",
        4,
        "linear",
        {"causal": True, "decay": True, "den": True, "mask": True},
    ),
    (
        "linear_causal_rpe_decay",
        4,
        "linear",
        {"causal": True, "rpe": True, "decay": True, "mask": True},
    ),
]
SLOW_CASES = [
    ("toeplitz", 4, "toeplitz", {}),
    ("linear_rpe_den", 4, "linear", {"rpe": True, "den": True, "mask": True}),
    ("toeplitz_p2", 2, "toeplitz", {"causal": True}),
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

  def rel(a, r):
    return float(jnp.max(jnp.abs(a - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-300))

  def one_case(devices, op, opts):
    rng = np.random.default_rng(0)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("seq",))
    n = 8 * devices  # 8 positions per device (chunk 3: a partial chunk per block)
    causal = opts.get("causal", False)
    split = P(None, "seq")
    if op == "toeplitz":
      args = {"w": rng.normal(size=(2, 2 * n - 1)), "x": rng.normal(size=(3, 2, n, 5))}
      specs = {"w": P(), "x": P(None, None, "seq")}
      out_spec = P(None, None, "seq")
      full = lambda a: toeplitz.toeplitz_matmul(a["w"], a["x"], causal=causal)
      local = lambda a: cp.toeplitz_matmul(a["w"], a["x"], axis_name="seq", causal=causal)
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
    args = {k: jnp.asarray(v) for k, v in args.items()}
    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=out_spec))
    ref = full(args)
    errs = {"out": rel(sharded(args), ref)}
    cot = jnp.asarray(np.random.default_rng(1).normal(size=ref.shape))
    wrt = [k for k in args if k != "mask"]

    def loss(fn, diff):
      return jnp.sum(fn({**args, **diff}) * cot)

    diff = {k: args[k] for k in wrt}
    got = jax.jit(jax.grad(lambda dd: loss(sharded, dd)))(diff)
    want = jax.grad(lambda dd: loss(full, dd))(diff)
    errs.update({f"grad {k}": rel(got[k], want[k]) for k in wrt})
    return errs

  return {name: one_case(devices, op, opts) for name, devices, op, opts in cases}


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


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_split_equals_unsplit(results, case):
  errs = results[case]
  assert len(errs) >= 2  # the output and at least one gradient
  bad = {k: e for k, e in errs.items() if not e < TOL}
  assert not bad, f"{case}: relative errors above {TOL}: {bad}"


@pytest.mark.slow
def test_split_equals_unsplit_more_cases():
  res = _run(SLOW_CASES)
  bad = {(case, k): e for case, errs in res.items() for k, e in errs.items() if not e < TOL}
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
