"""A sequence split over devices (mesh axis "seq") gives the unsplit layer, model and train step.

4 simulated CPU devices in one subprocess (the device count is fixed when JAX starts): for
each case the attention layer or the whole model runs once unsplit and once under a mesh
(data=1, seq=4), inputs sharded along the sequence, and the subprocess prints the relative
error of the output and the worst over every parameter gradient (float64 activations and
parameters, held to 1e-9). Padding is on in every case; the CLS case has N + 1 positions,
which the layer pads to a multiple of 4. Under the mesh the parameters take the trainer's
shardings (``tree_shardings``): a learned absolute table is split over "seq", and its
gradient comes back split. A 3-step training run with mesh.seq=2, mesh.data=2 (its absolute
table and Adam moments split over "seq") is compared with the same run on 1 device.
Configuration-time rejections run in process (in the default run). The split runs with
``-m slow`` (the default run holds the split on the ops, tests/ops/test_context_parallel.py):
every scheme once, the kernels whose features reach across the sequence (sikf, favor: a key
stabiliser shared by the keys of every block) and a per-token map of each kind (relu, nprf:
elementwise, a normalised random projection) in one subprocess with the training run, and
every kernel once as a layer and every kernel x scheme model cell in another.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from fastpos.models import TaskInfo, build_model
from fastpos.models import context_parallel as cp
from fastpos.train import sharding as sharding_lib
from fastpos.train import train_and_evaluate
from tests.helpers import run_on_devices
from tests.models.test_models import _cfg
from tests.train.common import tiny_config

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-9
LINEAR = ("elu1", "relu", "sikf", "dpfp", "favor", "prf", "trf", "nprf", "orf")
SCHEMES = ("fastrpb", "kernelized_rpe", "rope", "lrpe", "permuteformer")
DECAY = {"permuteformer": {"decay": 0.9}}  # the causal cells run PermuteFormer with a decay


def _layer_case(kernel: str, scheme: str, causal: bool) -> tuple:
  return (
      f"layer_{kernel}_{scheme}_{'causal' if causal else 'bidir'}",
      "layer",
      kernel,
      scheme,
      causal,
      "mean",
  )


# Layer cases (`-m slow`): every linear kernel once, each with a scheme, causal every other one.
LAYER_CASES = [_layer_case(k, SCHEMES[i % 5], bool(i % 2)) for i, k in enumerate(LINEAR)]
# The first subprocess: the causal ring Toeplitz product (kernelized RPE) and RoPE (the one scheme
# the model cases leave out), with two per-token kernels the model cases leave out. The other
# kernels (dpfp, prf, trf, orf: features of one token each, nothing shared across blocks) run
# as layers with `-m slow` (LAYER_CASES), and every kernel x scheme pair both ways as a model
# cell (matrix_cases).
DEFAULT_LAYER_CASES = [
    _layer_case("relu", "kernelized_rpe", True),
    _layer_case("nprf", "rope", True),
    # The causal layer by chunks (model.attn_chunk=3) under the mesh, the whole layer unsplit.
    ("layer_sikf_fastrpb_causal_chunked", "layer_chunked", "sikf", "fastrpb", True, "mean"),
]
# Model cases: (name, "model", kernel, positional, causal, pooling); mean pooling in a
# classifier is in the training run.
MODEL_CASES = [
    ("classify_sikf_kernelized_rpe_cls", "model", "sikf", "kernelized_rpe", False, "cls"),
    # A learned absolute table split over "seq" (and its gradient), with two relative schemes.
    (
        "lm_favor_absolute_permuteformer_lrpe",
        "model",
        "favor",
        "absolute+permuteformer+lrpe",
        True,
        "mean",
    ),
    # Two layers under nn.scan with nn.remat: shard_map inside the scanned, rematted body.
    ("lm_elu1_fastrpb_scan_remat", "model_scan", "elu1", "fastrpb", True, "mean"),
]
# Model cases of the slow run only (what they check, the default ones check too).
SLOW_MODEL_CASES = [
    ("lm_favor_permuteformer_lrpe", "model", "favor", "permuteformer+lrpe", True, "mean"),
    ("classify_sikf_absolute_fastrpb", "model", "sikf", "absolute+fastrpb", False, "mean"),
    # Scanned layers keying their fixed projections by the layer index, inside shard_map.
    ("lm_prf_fastrpb_scan_remat", "model_scan", "prf", "fastrpb", True, "mean"),
    (
        "classify_nprf_kernelized_rpe_scan_remat",
        "model_scan",
        "nprf",
        "kernelized_rpe",
        False,
        "mean",
    ),
]
TABLE = "pos_absolute']['table']"  # the learned absolute table's path (jax keystr)
TRAIN_OVERRIDES = {
    "batch_size": 8,
    "num_train_steps": 3,
    "eval_every_steps": 3,
    "checkpoint_every_steps": 3,
    "optimizer.eps": 1e-4,
    "model.kernel": "sikf",
    "model.positional": "absolute,fastrpb,rope",
    "model.pooling": "mean",
}


def _incompatible(kernel: str, pos: str, causal: bool) -> bool:
  from fastpos.positional import compatibility

  names = pos.split("+")
  opts = {n: DECAY.get(n, {}) if causal else {} for n in names}
  try:
    compatibility.plan(kernel, names, compatibility.Setting(causal=causal), options=opts)
  except ValueError:
    return True
  return False


def matrix_cases():
  """Every linear kernel x scheme, bidirectional (classifier, mean pooling) and causal (LM)."""
  return [
      (f"{'lm' if causal else 'classify'}_{k}_{s}", "model", k, s, causal, "mean")
      for causal in (False, True)
      for k in LINEAR
      for s in SCHEMES
      if not _incompatible(k, s, causal)
  ]


def table_specs(tree) -> dict[str, list]:
  """{path: [global shape, shape on one device]} of the absolute tables in ``tree``
  (parameters, gradients, moments)."""
  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    name = jax.tree_util.keystr(path)
    if TABLE in name:
      out[name] = [list(x.shape), list(x.sharding.shard_shape(x.shape))]
  return out


def split_along_positions(specs: dict, devices: int) -> bool:
  """Every table of ``specs`` (``table_specs``) holds 1/devices of the rows on each device."""
  return all(
      local == [rows // devices, d] and rows % devices == 0 for (rows, d), local in specs.values()
  )


def run_cases(cases, group: int = 12) -> dict[str, dict[str, float]]:
  """Runs in the subprocess: {case: {"out": rel err, "grad": worst rel err over leaves}}.

  The inits of up to ``group`` cases are one program (one compile instead of one per case);
  each case's step is its own program (several cases' gradients in one program compiled no
  faster)."""
  if len(cases) > group:
    return {
        k: v
        for i in range(0, len(cases), group)
        for k, v in run_cases(cases[i : i + group]).items()
    }
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from fastpos.train.sharding import tree_shardings
  from tests.helpers import rel_err

  mesh = Mesh(np.array(jax.devices()).reshape(1, 4), ("data", "seq"))
  built = [_build_case(*case) for _, *case in cases]
  inits, applies, inputs = (list(x) for x in zip(*built))

  @jax.jit
  def init(inputs):
    return [_perturbed(f(jax.random.key(0), x)) for f, x in zip(inits, inputs)]

  def one_case(apply, variables, inputs):
    def loss(v, b):
      out = apply(v, b)
      out = out[0] if isinstance(out, tuple) else out
      return jnp.sum(jnp.sin(out.astype(jnp.float64))), out

    (_, out0), g0 = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables, inputs)
    with jax.set_mesh(mesh):
      split = jax.device_put(inputs, NamedSharding(mesh, P("data", "seq")))
      placed = jax.device_put(variables, tree_shardings(variables, mesh, ()))
      (_, out1), g1 = jax.jit(jax.value_and_grad(loss, has_aux=True))(placed, split)
    grads = [rel_err(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0))]
    return {
        "out": rel_err(out1, out0),
        "grad": max(grads),
        "leaves": len(grads),
        "table_specs": table_specs({"param": placed, "grad": g1}),
    }

  variables = init(inputs)
  return {name: one_case(*args) for (name, *_), *args in zip(cases, applies, variables, inputs)}


def _build_case(what, kernel, pos, causal, pooling):
  """(init(key, inputs), apply(variables, inputs), inputs) of a case: float64, N = 16,
  padding on."""
  import jax.numpy as jnp

  from fastpos.models import Attention, AttentionConfig
  from tests.models.test_models import _batch

  names = pos.split("+")
  c = _cfg(kernel=kernel, positional=pos, dtype="float64", pooling=pooling, num_layers=1)
  if what == "model_scan":
    c.update(num_layers=2, scan_layers=True, remat="block")
  if causal:
    c.positional_options = {n: DECAY[n] for n in names if n in DECAY}
  n = 16
  task = TaskInfo("lm" if causal else "classify", 13, 0 if causal else 3, n)
  batch = _batch(2, n, pad=3)
  if what.startswith("layer"):
    model = chunked = Attention(AttentionConfig.from_model_config(c, task), dtype=jnp.float64)
    if what == "layer_chunked":  # by chunks of 3 of each device's 4 positions
      c.attn_chunk = 3
      chunked = Attention(AttentionConfig.from_model_config(c, task), dtype=jnp.float64)
    x = jax.random.normal(jax.random.key(1), (2, n, c.embed_dim), jnp.float64)
    return (
        lambda key, b: model.init(key, b["x"], mask=b["mask"]),
        # Under the mesh (traced there) the chunked layer; unsplit, the whole one.
        lambda v, b: (chunked if cp.seq_size() > 1 else model).apply(v, b["x"], mask=b["mask"]),
        {"x": x, "mask": batch["mask"]},
    )
  model = build_model(c, task)
  return model.init, model.apply, batch


def _perturbed(variables):
  """float64 parameters, moved off their init so that no table starts at zero."""
  import jax.numpy as jnp

  leaves, tree = jax.tree.flatten(variables)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  return jax.tree.unflatten(
      tree,
      [
          x.astype(jnp.float64) + 0.2 * jax.random.normal(k, x.shape, jnp.float64)
          for k, x in zip(keys, leaves)
      ],
  )


def run_training(out: str) -> dict:
  """Runs in the subprocess: 3 steps with mesh.seq=2, mesh.data=2; its metrics, params and
  the shardings of the absolute table and its Adam moments."""
  r = train_and_evaluate(tiny_config(**TRAIN_OVERRIDES, **{"mesh.seq": 2}), out + "/run")
  leaves = jax.tree.leaves(r["state"].params)
  np.savez(out + "/params.npz", *[np.asarray(x) for x in leaves])
  state = {"params": r["state"].params, "opt_state": r["state"].opt_state}
  return {"train": r["train"], "validation": r["validation"], "table_specs": table_specs(state)}


_SCRIPT = """
import json, sys
import jax
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
from tests.models import test_context_parallel as t
assert jax.device_count() == 4, jax.devices()
out, names = sys.argv[1], set(sys.argv[2].split(","))
cases = list({c[0]: c for c in t.ALL_CASES + t.matrix_cases() if c[0] in names}.values())
result = {"cases": t.run_cases(cases)}
if "train" in names:
  result["train"] = t.run_training(out)
print("RESULT" + json.dumps(result))
"""


ALL_CASES = DEFAULT_LAYER_CASES + LAYER_CASES + MODEL_CASES + SLOW_MODEL_CASES
# The layer cases of the slow run: LAYER_CASES that the default run leaves out.
SLOW_LAYER_CASES = [c for c in LAYER_CASES if c[0] not in {d[0] for d in DEFAULT_LAYER_CASES}]


def _run(tmp: Path, names) -> dict:
  return run_on_devices(_SCRIPT, str(tmp), ",".join(names), timeout=3000)


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("split")
  return tmp, _run(tmp, [c[0] for c in DEFAULT_LAYER_CASES + MODEL_CASES] + ["train"])


# Slow (one 4-device subprocess for every case); the default run keeps the split on the ops:
# tests/ops/test_context_parallel.py::test_split_equals_unsplit.
@pytest.mark.slow
@pytest.mark.parametrize("case", [c[0] for c in DEFAULT_LAYER_CASES + MODEL_CASES])
def test_split_sequence_equals_unsplit(split_run, case):
  errs = split_run[1]["cases"][case]
  assert errs["leaves"] >= 4  # projections and the scheme's parameters all compared
  assert errs["out"] < TOL and errs["grad"] < TOL, errs
  if "absolute" in case:  # the table and its gradient are split along positions, not copied
    assert len(errs["table_specs"]) == 2, errs["table_specs"]
    assert split_along_positions(errs["table_specs"], 4), errs


# Slow (it shares the subprocess above); the default run keeps the op-level split.
@pytest.mark.slow
def test_train_step_with_seq2_data2_equals_one_device(split_run, tmp_path):
  tmp, result = split_run
  one = train_and_evaluate(tiny_config(**TRAIN_OVERRIDES), tmp_path / "one")
  for split in ("train", "validation"):
    for metric in ("loss", "accuracy"):
      want = one[split][metric]
      got = result["train"][split][metric]
      assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (split, metric, got, want)
  specs = result["train"]["table_specs"]
  assert len(specs) == 3 and split_along_positions(specs, 2), specs
  ref = [np.asarray(x) for x in jax.tree.leaves(one["state"].params)]
  got = np.load(tmp / "params.npz")
  assert len(got.files) == len(ref) > 4
  scale = max(np.max(np.abs(r)) for r in ref)
  for i, r in enumerate(ref):
    assert np.max(np.abs(got[f"arr_{i}"] - r)) < 1e-5 * scale, i


@pytest.mark.slow
def test_every_kernel_and_scheme_split_equals_unsplit(tmp_path):
  cases = matrix_cases() + SLOW_LAYER_CASES + SLOW_MODEL_CASES
  res = _run(tmp_path, [c[0] for c in cases])["cases"]
  print(json.dumps(res, indent=1))
  assert len(res) == len(cases) >= 80 + len(SLOW_LAYER_CASES) + len(SLOW_MODEL_CASES)
  bad = {k: e for k, e in res.items() if not (e["out"] < TOL and e["grad"] < TOL)}
  assert not bad, bad


@pytest.mark.parametrize(
    "kernel, pos, two_d, match",
    [
        ("softmax", "fastrpb", False, "kernel 'softmax' materialises"),
        ("elu1", "spe", False, "positional scheme 'spe': its features hook acts before"),
        ("softmax", "t5_bias", False, "kernel 'softmax'"),
        ("elu1", "fastrpb", True, "2D grids are not split"),
    ],
)
def test_unsupported_split_is_rejected_naming_it(kernel, pos, two_d, match):
  from fastpos.positional import compatibility

  with pytest.raises(ValueError, match=match) as e:
    compatibility.plan(kernel, [pos], compatibility.Setting(two_d=two_d, seq=2))
  assert "support the kernels elu1, relu" in str(e.value)
  assert "schemes none, absolute, fastrpb, kernelized_rpe, rope, lrpe, permuteformer;" in str(
      e.value
  )
  compatibility.plan(kernel, [pos], compatibility.Setting(two_d=two_d))  # one block: all go


def test_logits_schemes_are_named():
  from fastpos.ops.features import get_kernel
  from fastpos.positional.compatibility import split_problem

  assert "logits hook" in split_problem(get_kernel("elu1"), ["t5_bias"], two_d=False)
  assert "logits hook" in split_problem(get_kernel("elu1"), ["transformer_xl"], two_d=False)
  assert split_problem(get_kernel("nprf"), ["kernelized_rpe", "permuteformer"], two_d=False) is None


def test_the_trainer_checks_the_split_before_compiling():
  mesh = AbstractMesh((1, 2), ("data", "seq"))
  task = TaskInfo("classify", 13, 3, 12)
  model = build_model(_cfg(kernel="softmax"), task)
  with pytest.raises(ValueError, match="mesh.seq=2 splits each sequence over 2 devices"):
    sharding_lib.check_seq_split(mesh, 12, model)
  with pytest.raises(ValueError, match="mesh.seq=2 must divide the sequence length 13"):
    sharding_lib.check_seq_split(mesh, 13, build_model(_cfg(kernel="elu1"), task))
  sharding_lib.check_seq_split(mesh, 12, build_model(_cfg(kernel="elu1"), task))
