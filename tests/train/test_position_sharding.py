"""Which devices hold a position table: ``sharding.tree_shardings`` with a "seq" axis splits
every parameter indexed by absolute position (and its optimizer moments) along it; a table
that does not divide stays replicated with a warning; a configured rule wins; without a "seq"
axis nothing changes. Abstract meshes: no devices needed (the equality of split and
replicated tables, outputs and gradients, is in tests/models/test_context_parallel.py)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from fastpos.train import sharding as sharding_lib


def _state(rows: int):
  table = jax.ShapeDtypeStruct((rows, 8), jnp.float32)
  other = jax.ShapeDtypeStruct((8, 8), jnp.float32)
  params = {"encoder": {"pos_absolute": {"table": table}, "embed": {"embedding": other}}}
  return {"params": params, "opt_state": {"mu": params, "nu": params}}


def _specs(tree):
  """{path: spec}, trailing Nones dropped (P(None, None) is P())."""
  out = {}
  for path, s in jax.tree_util.tree_leaves_with_path(tree):
    spec = list(s.spec)
    while spec and spec[-1] is None:
      spec.pop()
    out[sharding_lib.leaf_name(path)] = P(*spec)
  return out


def test_tables_and_moments_split_over_seq_the_rest_replicated():
  mesh = AbstractMesh((1, 4, 1), ("data", "seq", "model"))
  specs = _specs(sharding_lib.tree_shardings(_state(16), mesh, ()))
  tables = {k: v for k, v in specs.items() if k.endswith("pos_absolute/table")}
  assert len(tables) == 3 and set(tables.values()) == {P("seq")}, specs
  assert all(v == P() for k, v in specs.items() if k not in tables), specs


def test_a_table_that_does_not_divide_stays_replicated_and_says_so(caplog):
  mesh = AbstractMesh((1, 4, 1), ("data", "seq", "model"))
  with caplog.at_level(logging.WARNING):
    specs = _specs(sharding_lib.tree_shardings(_state(17), mesh, ()))
  assert set(specs.values()) == {P()}
  assert "not divisible by mesh.seq=4" in caplog.text
  assert "pos_absolute/table (17, 8)" in caplog.text


def test_configured_rules_win_and_no_seq_axis_changes_nothing():
  mesh = AbstractMesh((1, 4, 1), ("data", "seq", "model"))
  keep = ((r"pos_absolute/table$", (None, None)),)
  assert set(_specs(sharding_lib.tree_shardings(_state(16), mesh, keep)).values()) == {P()}
  flat = AbstractMesh((4, 1), ("data", "model"))
  assert set(_specs(sharding_lib.tree_shardings(_state(16), flat, ())).values()) == {P()}
