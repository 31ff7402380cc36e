"""Devices and shardings: one mesh over every device, batches split on "data".

The mesh has axes ("data", "model"); ``config.mesh.model`` devices go on the model axis, the
rest on the data axis. Batches are sharded over "data" (and replicated over "model");
parameters are replicated unless a rule of ``config.mesh.rules`` shards them. With several
processes (``fastpos.train.distributed``: one per host, or one per accelerator) the mesh spans
every process's devices, process by process; each process reads its own rows of every global
batch and the global array is assembled with ``jax.make_array_from_process_local_data``. A
"seq" axis may span processes: those holding the blocks of the same rows read the same rows
(``row_group``), and each device keeps its own blocks; the ring and scans of the split
sequence then pass blocks between processes (gloo on CPU).

Launch a multi-process run with the same command on every process plus where to meet, e.g. on
one machine ``scripts/launch_local.sh 2 -- train.py --config=... --workdir=...``, or by hand::

  python train.py --config=... --workdir=DIR --coordinator_address=HOST0:1234 \\
      --num_processes=2 --process_id=0     # on host 0; --process_id=1 on host 1

(the environment variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID`` work too; SLURM, Open MPI and Cloud TPU pods need none of them).
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fastpos import positional
from fastpos.positional import compatibility
from fastpos.train import distributed

DATA, MODEL = "data", "model"
SEQ = "seq"  # context parallelism: token arrays split along their sequence dimension


def maybe_initialize_distributed() -> None:
  """Joins the other processes of a multi-process run as ``fastpos.train.distributed``
  describes, from the environment variables (``JAX_COORDINATOR_ADDRESS``,
  ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) or a cluster JAX detects (SLURM, Open MPI, Cloud
  TPU); for programs without the ``--coordinator_address`` flags. Must run before anything
  touches the devices."""
  distributed.initialize()


def make_mesh(cfg: ml_collections.ConfigDict, devices: list | None = None) -> Mesh:
  """The ("data", "model") mesh over ``devices`` (default: all devices); with
  ``config.mesh.seq`` > 1 the ("data", "seq", "model") mesh, "seq" taking neighbouring
  devices (its ring passes blocks between them)."""
  devices = list(jax.devices() if devices is None else devices)
  model = cfg.mesh.model
  if model < 1 or len(devices) % model:
    raise ValueError(
        f"config.mesh.model={model} must be >= 1 and divide the device count " f"{len(devices)}."
    )
  seq = cfg.mesh.get("seq", 1)
  if seq == 1:
    return Mesh(np.array(devices).reshape(len(devices) // model, model), (DATA, MODEL))
  if seq < 1 or len(devices) % (seq * model):
    raise ValueError(
        f"config.mesh.seq={seq} must be >= 1 and mesh.seq * mesh.model = "
        f"{seq * model} must divide the device count {len(devices)}."
    )
  return Mesh(
      np.array(devices).reshape(len(devices) // (seq * model), seq, model), (DATA, SEQ, MODEL)
  )


def seq_size(mesh: Mesh) -> int:
  """Devices on the "seq" axis (1 without one)."""
  return int(mesh.shape.get(SEQ, 1))


def check_seq_split(mesh: Mesh, length: int, model) -> None:
  """Stops with one clear message when the batches' sequences (``length`` tokens) cannot be
  split over the "seq" axis, or ``model`` cannot run on a split sequence. The "seq" axis may
  span processes (``row_group``)."""
  seq = seq_size(mesh)
  if seq == 1:
    return
  if length % seq:
    raise ValueError(
        f"config.mesh.seq={seq} must divide the sequence length {length} (the "
        f"task's max_length); choose a divisor of it."
    )
  if isinstance(mesh, Mesh):
    row_group(mesh)  # processes sharing rows must share all of them
  model.attention.plan(compatibility.Setting(seq=seq))


def _process_rows(mesh: Mesh) -> dict[int, frozenset]:
  """{process index: the indices along "data" of its devices}."""
  procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
  procs = np.moveaxis(procs, mesh.axis_names.index(DATA), 0).reshape(mesh.shape[DATA], -1)
  return {
      int(p): frozenset(np.nonzero(np.any(procs == p, axis=1))[0].tolist())
      for p in np.unique(procs)
  }


def row_group(mesh: Mesh, process: int | None = None) -> tuple[int, int]:
  """(index, count) of ``process``'s (default: this process's) row group on ``mesh``.

  Processes whose devices sit at the same indices of the "data" axis hold the same rows of
  every batch: the blocks of one sequence over a "seq" axis that spans them. They form one
  row group and read the same rows (each keeping the blocks of its own devices); groups are
  numbered by their first data index. Without a "seq" axis across processes every process is
  its own group, in process order. Raises ValueError when two processes share some rows but
  not all (no way to read whole rows per group).
  """
  rows = _process_rows(mesh)
  groups = sorted(set(rows.values()), key=lambda g: (min(g), sorted(g)))
  for i, a in enumerate(groups):
    for b in groups[i + 1 :]:
      if a & b:
        raise ValueError(
            f"the mesh {dict(mesh.shape)} puts processes on overlapping but different rows "
            f"of the data axis ({sorted(a)} and {sorted(b)}); order the devices so that each "
            "process's devices cover whole data rows, or the processes sharing a row share "
            "all of them."
        )
  mine = rows[jax.process_index() if process is None else process]
  return groups.index(mine), len(groups)


def data_reader(cfg: ml_collections.ConfigDict) -> tuple[int, int]:
  """(index, count) of the rows this process reads of every global batch: its ``row_group``
  on the mesh of ``cfg`` (``jax.process_index()``, ``jax.process_count()`` unless the "seq"
  axis spans processes)."""
  if jax.process_count() == 1:
    return 0, 1
  return row_group(make_mesh(cfg))


def in_seq_mesh(fn: Callable, mesh: Mesh) -> Callable:
  """``fn`` traced with ``mesh`` in context when it has a "seq" axis, so that the attention
  layers run on the split sequence (``fastpos.models.context_parallel``); ``fn`` otherwise."""
  if seq_size(mesh) == 1:
    return fn

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)

  return wrapped


def check_batch_sizes(cfg: ml_collections.ConfigDict, mesh: Mesh) -> None:
  """Stops with one clear message when a batch cannot be split over devices and hosts."""
  data = mesh.shape[DATA]
  procs = row_group(mesh)[1] if jax.process_count() > 1 else 1
  for name, size in (
      ("batch_size", cfg.batch_size),
      ("eval_batch_size", cfg.eval_batch_size or cfg.batch_size),
  ):
    if size < 1 or size % data or size % procs:
      raise ValueError(
          f"config.{name}={size} is not divisible by the {data} device(s) of the data axis "
          f"({jax.device_count()} devices, mesh.model={cfg.mesh.model}, {procs} process(es) "
          "reading different rows); "
          f"use a multiple of {np.lcm(data, procs)}."
      )
  accum = cfg.grad_accum_steps
  if accum < 1 or (cfg.batch_size // data) % accum:
    raise ValueError(
        f"config.grad_accum_steps={accum} must divide the per-device batch "
        f"{cfg.batch_size // data} (batch_size={cfg.batch_size} over {data} device(s))."
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(DATA))


def batch_in_sharding(mesh: Mesh) -> NamedSharding | None:
  """A jitted step's ``in_shardings`` entry for a batch: None (each field keeps the sharding
  ``global_batch`` gave it) when token arrays are split over "seq"."""
  return batch_sharding(mesh) if seq_size(mesh) == 1 else None


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def leaf_name(path) -> str:
  """``params/embed/embedding``: a pytree path as slash-joined keys, the same name for a
  ``TrainState`` leaf and for the leaf of the nested dicts a checkpoint restores to."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
  return "/".join(parts)


def position_rules() -> tuple:
  """Rules ``(regex, spec)`` that put every parameter indexed by absolute position (a scheme's
  ``position_params``, e.g. the learned absolute table ``[max_length, D]``) on the "seq" axis
  along its position axis: with the sequence split over "seq", device p holds the rows of its
  own block of positions, and so do the gradient and the optimizer moments."""
  rules = []
  for name, cls in positional.SCHEMES.items():
    for param, (rank, axis) in getattr(cls, "position_params", {}).items():
      spec = [None] * rank
      spec[axis] = SEQ
      rules.append((rf"(^|/)pos_{re.escape(name)}(_shared)?/{re.escape(param)}$", tuple(spec)))
  return tuple(rules)


def tree_shardings(tree: Any, mesh: Mesh, rules) -> Any:
  """NamedShardings for a tree of arrays / ShapeDtypeStructs by ``config.mesh.rules``.

  A rule ``(regex, spec)`` applies to leaves whose "/"-joined path matches ``regex``
  (``re.search``) and whose rank equals ``len(spec)``; every sharded dimension must be
  divisible by its mesh axis. Unmatched leaves (and optimizer moments of unmatched
  parameters) are replicated. With a "seq" axis (``mesh.seq`` > 1) the ``position_rules``
  follow the configured ones: position tables are split over "seq" where their length
  divides (a table one row longer than the sequence, for a CLS token, stays replicated and a
  warning says so).
  """
  compiled = [(re.compile(regex), tuple(spec)) for regex, spec in rules]
  positions = (
      [(re.compile(regex), spec) for regex, spec in position_rules()] if seq_size(mesh) > 1 else []
  )

  def divisible(leaf, spec) -> bool:
    return all(
        axis is None or dim % mesh.shape[axis] == 0 for dim, axis in zip(np.shape(leaf), spec)
    )

  def one(path, leaf):
    name = leaf_name(path)
    for regex, spec in compiled:
      if regex.search(name) and len(spec) == np.ndim(leaf):
        if not divisible(leaf, spec):
          axis = next(a for d, a in zip(np.shape(leaf), spec) if a and d % mesh.shape[a])
          raise ValueError(
              f"sharding rule {regex.pattern!r}: {name} has shape "
              f"{np.shape(leaf)}, not divisible by mesh axis {axis!r} of size "
              f"{mesh.shape[axis]}."
          )
        return NamedSharding(mesh, P(*spec))
    for regex, spec in positions:
      found = regex.search(name)
      if found and len(spec) == np.ndim(leaf):
        if divisible(leaf, spec):
          return NamedSharding(mesh, P(*spec))
        unsplit.add(f"{found.group(0).lstrip('/')} {np.shape(leaf)}")
    return NamedSharding(mesh, P())

  unsplit = set()
  out = jax.tree_util.tree_map_with_path(one, tree)
  if unsplit:
    logging.warning(
        "not divisible by mesh.seq=%d, so replicated on every device: %s",
        seq_size(mesh),
        ", ".join(sorted(unsplit)),
    )
  return out


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
  """This process's rows -> one global array per field, sharded over the data axis (and the
  token arrays ``[B, N, ...]`` along N over "seq" when the mesh has that axis). The processes
  of a row group (``row_group``) pass the same whole rows; each device takes its blocks."""
  procs = row_group(sharding.mesh)[1] if jax.process_count() > 1 else 1
  tokens = NamedSharding(sharding.mesh, P(DATA, SEQ)) if seq_size(sharding.mesh) > 1 else None

  def one(x):
    x = np.asarray(x)
    where = tokens if tokens is not None and x.ndim >= 2 else sharding
    return jax.make_array_from_process_local_data(where, x, (x.shape[0] * procs,) + x.shape[1:])

  return {k: one(v) for k, v in local.items()}
