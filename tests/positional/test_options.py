"""One option spec per scheme, one validator (``Scheme.resolve_options``): every scheme's
options are declared once and checked the same way at configuration time and at build."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from fastpos import positional
from fastpos.positional import Dims, KernelInfo, Option, compatibility

DIMS = Dims(num_heads=2, head_dim=4, feature_dim=4, embed_dim=8, max_length=6)
OPTIONS = [(s, n) for s, cls in positional.SCHEMES.items() for n in cls.option_spec]


def _bad_value(option: Option):
  """A value the option refuses."""
  if option.choices is not None:
    return "no-such-choice" if option.type == "str" else 99
  return {"bool": "yes", "int": 1.5, "number": "1.0", "str": 3, "any": object()}[option.type]


def test_every_scheme_declares_its_options_once():
  for name, cls in positional.SCHEMES.items():
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    assert positional.option_names(name) == tuple(cls.option_spec)
    for opt, spec in cls.option_spec.items():
      assert spec.doc, (name, opt)
      assert fields[opt].default == spec.default, (name, opt)  # the field comes from the spec
    resolved = cls.resolve_options({})
    assert resolved == {n: o.default for n, o in cls.option_spec.items()}  # defaults are valid


@pytest.mark.parametrize("scheme, option", OPTIONS)
def test_a_bad_value_is_refused_with_the_scheme_option_value_and_choices(scheme, option):
  spec = positional.get_class(scheme).option_spec[option]
  bad = _bad_value(spec)
  assert not spec.is_valid(bad)
  # Configuration time (the compatibility table) ...
  with pytest.raises(ValueError) as config_time:
    compatibility.problem("softmax", scheme, options={option: bad})
  message = str(config_time.value)
  assert message.startswith(f"{scheme}: ") and option in message and repr(bad) in message
  assert spec.describe() in message or spec.choice_list() in message
  # ... and at build, whichever hooks the scheme has (setup runs the same validator).
  module = positional.build(scheme, DIMS, {option: bad}).bind({})
  with pytest.raises(ValueError, match=re.escape(message)):
    module._try_setup()


def test_unknown_option_names_the_valid_ones():
  with pytest.raises(
      ValueError,
      match="unknown option 'kind' for positional scheme 'lrpe'; "
      "valid options: type, p, learnable_theta",
  ):
    positional.build("lrpe", DIMS, {"kind": 1})
  with pytest.raises(ValueError, match=r"valid options: \(none\)"):
    positional.get_class("none").resolve_options({"x": 1})


@pytest.mark.parametrize(
    "option, value, ok, words",
    [
        (Option(1, "d", type="int", low=1), 0, False, "an integer >= 1"),
        (Option(1, "d", type="int", low=1), True, False, "an integer >= 1"),
        (Option(2, "d", type="int", low=2, even=True), 4, True, "an even integer >= 2"),
        (Option(2, "d", type="int", low=2, even=True), 3, False, "an even integer >= 2"),
        (
            Option(0.5, "d", type="number", low=0, low_open=True, high=1),
            1.0,
            True,
            "a finite number > 0 and <= 1",
        ),
        (
            Option(0.5, "d", type="number", low=0, low_open=True),
            float("nan"),
            False,
            "a finite number > 0",
        ),
        (Option(None, "d", type="bool", none_ok=True), None, True, "None, True or False"),
        (Option(None, "d", type="int", none_ok=True), 1, True, "None or an integer"),
        (Option("a", "d", type="str", choices=("a", "b")), "c", False, "one of a, b"),
        (
            Option(1, "d", type="int", choices={1: "one", 2: "two"}),
            2,
            True,
            "one of 1 (one), 2 (two)",
        ),
    ],
)
def test_option_validates_and_describes(option, value, ok, words):
  assert option.is_valid(value) is ok
  assert option.describe() == words


def test_choices_refuse_bools_for_ints_and_name_every_choice():
  spec = positional.get_class("lrpe").option_spec["type"]
  assert not spec.is_valid(True) and spec.is_valid(2)
  assert spec.error("lrpe", "type", True) == (
      "lrpe: unknown type True; valid choices: 1 (unitary, complex), 2 (orthogonal rotations), "
      "3 (permutation)."
  )


def test_no_scheme_module_checks_option_types_itself():
  # One validator: the per-file _is_int / _is_bool helpers and option checkers are gone.
  root = Path(positional.__file__).parent
  for module in positional.SCHEME_MODULES:
    path = root / f"{module}.py"
    tree = ast.parse(path.read_text())
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert not names & {
        "_is_int",
        "_is_bool",
        "_is_real",
        "check_options",
        "check_base",
        "check_seed",
        "check_decay",
        "check_rel_dim",
    }, path.name


def test_relations_between_options():
  with pytest.raises(ValueError, match="learnable_theta=True needs type 1 or 2"):
    positional.get_class("lrpe").resolve_options({"type": 3, "learnable_theta": True})
  with pytest.raises(
      ValueError, match=re.escape("max_distance must be an integer > " "num_buckets // 2 = 8")
  ):
    positional.get_class("t5_bias").resolve_options({"num_buckets": 16, "max_distance": 8})
  assert (
      positional.get_class("t5_bias").resolve_options(
          {"bucketed": False, "num_buckets": 16, "max_distance": 8}
      )["bucketed"]
      is False
  )
  assert KernelInfo("softmax").is_softmax


def test_the_options_of_a_config_are_checked_once_for_every_layer(monkeypatch):
  # Each layer's setup, plan and compatibility ask resolve_options again; the full check (the
  # rules between options included) runs once per set of options, and a bad value is refused
  # every time it is asked (only what passed is remembered).
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from fastpos.models import build_model, model_config  # pylint: disable=import-outside-toplevel
  from fastpos.positional import base  # pylint: disable=import-outside-toplevel
  from fastpos.tasks.info import TaskInfo  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(base, "_RESOLVED", {})
  cls = positional.get_class("fastrpb")
  calls = []
  real = cls.check_relations.__func__
  monkeypatch.setattr(
      cls, "check_relations", classmethod(lambda c, o: calls.append(1) or real(c, o))
  )
  cfg = model_config()
  cfg.update(positional="fastrpb", num_layers=3, embed_dim=8, num_heads=2, mlp_dim=8)
  cfg.positional_options = {"fastrpb": {"per_head": True}}
  model = build_model(cfg, TaskInfo(kind="classify", vocab_size=9, num_classes=2, max_length=6))
  jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 6), jnp.int32))  # traced, not run
  assert len(calls) == 1
  bad = {"per_head": 1}  # equal to True, but not a bool: not the remembered answer
  for _ in range(2):
    with pytest.raises(ValueError, match="per_head"):
      cls.resolve_options(bad)
  assert len(calls) == 1
