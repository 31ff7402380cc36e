"""The API reference builds (pdoc, as scripts/build_docs.sh runs it) and documents every public
name of ``fastpos.__all__`` with its docstring; every public name has a docstring example, and
every docstring example of the package runs as written and matches its comments (shapes as
``# [2, 10, 32]``, values as ``# <repr>``). The examples that read a trained run run in
tests/test_api_load.py, on its run."""

from __future__ import annotations

import ast
import dataclasses
import doctest
import functools
import glob
import html
import os
import re
import subprocess
import textwrap

import pytest

import fastpos

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every example runs eagerly: each operation of a new shape is its own compile, and the
# examples share many of them. On one xdist worker (tests/conftest.py) each is compiled once.
pytestmark = pytest.mark.xdist_group("api_docs")


def test_api_reference_documents_every_public_name(tmp_path):
  out = subprocess.run(
      ["bash", os.path.join(ROOT, "scripts", "build_docs.sh"), str(tmp_path / "api")],
      capture_output=True,
      text=True,
      cwd=ROOT,
      env={**os.environ, "PYTHONPATH": ROOT},
      timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  page = (tmp_path / "api" / "fastpos.html").read_text(encoding="utf-8")
  for name in fastpos.__all__:
    section = re.search(rf'<section id="{name}">(.*?)</section>', page, re.S)
    assert section, f"fastpos.{name} is not in the API reference"
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", section.group(1))).split())
    obj = getattr(fastpos, name)
    if getattr(obj, "__name__", name) != name:  # another name of a public class: pdoc links it
      assert obj.__name__ in fastpos.__all__ and re.search(rf"\b{obj.__name__}\b", text), name
      continue
    words = " ".join(obj.__doc__.replace("`", "").split()[:3])
    assert words in text.replace(" ,", ","), f"fastpos.{name}: its docstring is not shown"


# ---- every docstring example of the package runs ---------------------------------------------

EXAMPLE_SCOPE = ("fastpos", "jax", "jnp", "nn")  # what the examples assume (fastpos.__doc__)
_SHAPE = re.compile(r"#\s*\[(\d+(?:, \d+)*)\]")


@dataclasses.dataclass(frozen=True)
class Example:
  where: str  # "<file>:<line> <object>"
  code: str
  doctest: bool  # ">>>" lines rather than an ``Example::`` block

  def __str__(self) -> str:
    return self.where


def _blocks(doc: str) -> list[str]:
  """The literal blocks that follow ``Example::`` lines, dedented."""
  lines, out = doc.splitlines(), []
  for i, line in enumerate(lines):
    if line.strip() != "Example::":
      continue
    indent, body = len(line) - len(line.lstrip()), []
    for text in lines[i + 1 :]:
      if text.strip() and len(text) - len(text.lstrip()) <= indent:
        break
      body.append(text)
    out.append(textwrap.dedent("\n".join(body)).strip("\n"))
  return out


@functools.cache  # parsed once per process (this module and test_api_load collect them)
def package_examples() -> tuple[Example, ...]:
  """Every docstring example of ``fastpos/``: module, class and function docstrings with an
  ``Example::`` block or ``>>>`` lines."""
  out = []
  for path in sorted(glob.glob(os.path.join(ROOT, "fastpos", "**", "*.py"), recursive=True)):
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    rel = os.path.relpath(path, ROOT)
    nodes = [tree] + [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    for node in nodes:
      doc = ast.get_docstring(node, clean=True)
      if not doc:
        continue
      where = f"{rel}:{getattr(node, 'lineno', 1)} {getattr(node, 'name', '(module)')}"
      out += [Example(where, code, code.startswith(">>>")) for code in _blocks(doc)]
      if ">>>" in doc and "Example::" not in doc:
        out.append(Example(where, doc, True))
  return tuple(out)


def example_scope(**extra) -> dict:
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  return {"fastpos": fastpos, "jax": jax, "jnp": jnp, "nn": nn, **extra}


def _target(stmt) -> str | None:
  """The (first) name an assignment binds."""
  if not isinstance(stmt, ast.Assign):
    return None
  target = stmt.targets[0]
  if isinstance(target, ast.Tuple) and target.elts:
    target = target.elts[0]
  return target.id if isinstance(target, ast.Name) else None


def run_example(example: Example, scope: dict) -> None:
  """Runs ``example`` in ``scope`` statement by statement, holding each to its comments: an
  assignment's ``# [2, 10, 32]`` is the shape of the (first) name it binds, and a one-line bare
  expression's ``# <value>`` is the value's repr."""
  if example.doctest:
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(verbose=False)
    test = parser.get_doctest(example.code, scope, example.where, example.where, 0)
    result = runner.run(test, out=lambda s: None)
    assert result.failed == 0, f"{example}: {result.failed} doctest line(s) failed"
    return
  lines = example.code.splitlines()
  for stmt in ast.parse(example.code).body:
    module = ast.Module(body=[stmt], type_ignores=[])
    exec(compile(module, example.where, "exec"), scope)  # pylint: disable=exec-used
    text = lines[stmt.lineno - 1 : stmt.end_lineno]
    name = _target(stmt)
    shapes = [m for m in (_SHAPE.search(t) for t in text) if m]
    if name is not None and shapes:
      want = tuple(int(v) for v in shapes[0].group(1).split(","))
      got = tuple(getattr(scope[name], "shape", ()))
      assert got == want, f"{example}: {name} has shape {got}, not {want} ({text[0].strip()})"
    code, sep, comment = text[0].partition("  #")
    if isinstance(stmt, ast.Expr) and len(text) == 1 and sep:
      got = repr(eval(code.strip(), scope))  # pylint: disable=eval-used
      assert got == comment.strip(), f"{example}: {code.strip()} is {got}, not {comment.strip()}"


def needs_a_run(example: Example) -> bool:
  """Whether the example reads a trained run (``workdir``; tests/test_api_load.py runs it)."""
  return re.search(r"\bworkdir\b", example.code) is not None


_EXAMPLES = package_examples()
_QUICK = [e for e in _EXAMPLES if not needs_a_run(e)]


def test_every_public_name_has_an_example():
  missing = []
  for name in fastpos.__all__:
    doc = getattr(fastpos, name).__doc__ or ""
    if "Example::" not in doc and ">>>" not in doc:
      missing.append(name)
  assert not missing, f"public names without a docstring example: {missing}"
  assert len(_EXAMPLES) >= len(set(map(id, (getattr(fastpos, n) for n in fastpos.__all__))))


@pytest.mark.parametrize("example", _QUICK, ids=str)
def test_docstring_example_runs_as_written(example, monkeypatch):
  from fastpos import positional  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(positional, "SCHEMES", dict(positional.SCHEMES))  # registrations undone
  run_example(example, example_scope())


def test_the_example_checker_holds_examples_to_their_comments():
  bad_shape = Example("t", "x = jnp.ones((2, 3))  # [2, 4]", False)
  with pytest.raises(AssertionError, match=r"x has shape \(2, 3\), not \(2, 4\)"):
    run_example(bad_shape, example_scope())
  bad_value = Example("t", "1 + 1  # 3", False)
  with pytest.raises(AssertionError, match="1 \\+ 1 is 2, not 3"):
    run_example(bad_value, example_scope())
  run_example(Example("t", "y = jnp.ones((2, 3))  # [2, 3]\n2 * 2  # 4", False), example_scope())
