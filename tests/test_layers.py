"""Each layer of fastpos imports only downward. The allowed graph, top to bottom::

  train --> models --> positional --> ops
    |         :
    v         :  fastpos.tasks.info only (TaskInfo, which imports nothing)
  tasks <.....'

  layer          where                   may import (besides itself)
  train          fastpos/train/          every layer
  models         fastpos/models/         positional, ops, config_schema; fastpos.tasks.info
  positional     fastpos/positional/     ops (the scheme registry and the kernel x scheme table,
                                         positional.compatibility, included)
  ops            fastpos/ops/            fields (to declare the kernels' options)
  tasks          fastpos/tasks/          fields (each task declares its config.task block)
  config_schema  fastpos/config_schema   tasks, ops (it reads their declarations, on use)
  fields         fastpos/fields          nothing (the declaration vocabulary, a leaf)
  sweep          fastpos/sweep/          train (config loading, exit codes)
  plots          fastpos/plots/          nothing of fastpos (matplotlib helpers and figures)
  api            fastpos/api/            every layer but sweep (the public names' modules)

Every ``import`` / ``from ... import`` of every ``fastpos/**/*.py`` counts (also those inside
functions or ``if TYPE_CHECKING:``), and so do imports by name (``importlib.import_module``
with a literal or an f-string's literal prefix, and ``"module:Class"`` registry strings).
``fastpos/__init__.py`` is outside the layers. A new top-level module or package must be given
a layer here. Nothing of fastpos imports the repository's ``benchmarks``, ``scripts`` or
``tests`` (they are not installed with the package).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fastpos"

# layer -> the layers it may import (itself included).
ALLOWED = {
    "ops": {"ops", "fields"},
    "positional": {"positional", "ops", "fields"},
    "models": {"models", "positional", "ops", "config_schema", "fields"},
    "tasks": {"tasks", "fields"},
    "train": {
        "train",
        "models",
        "positional",
        "ops",
        "tasks",
        "config_schema",
        "fields",
        "interrupts",
    },
    "sweep": {"sweep", "train", "tasks", "plots", "config_schema", "fields"},
    "plots": {"plots"},
    "api": {"api", "train", "models", "positional", "ops", "tasks", "config_schema", "fields"},
    # The config's schema: the trainer's fields, and the owners' declarations read on use.
    "config_schema": {"config_schema", "fields", "tasks", "ops"},
    "fields": {"fields"},  # how a config field is declared: a leaf
    "interrupts": {"interrupts"},  # the programs' signal handling: standard library only
}
# Single modules a layer may import from outside its allowed layers.
EXTRA = {"models": {"fastpos.tasks.info"}}
# Modules that import nothing of fastpos.
LEAVES = {"fastpos.tasks.info", "fastpos.fields", "fastpos.interrupts"}

_REGISTRY_STRING = re.compile(r"fastpos(\.\w+)+:\w+")


def _module_name(path: Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def layer_of(module: str) -> str | None:
  """The layer of a fastpos module name; None for the package itself (``fastpos``)."""
  parts = module.split(".")
  if parts == ["fastpos"]:
    return None
  top = parts[1]
  if top not in ALLOWED:
    raise AssertionError(
        f"{module}: fastpos.{top} has no layer; add it to tests/test_layers.py "
        f"ALLOWED (layers: {', '.join(ALLOWED)})."
    )
  return top


def _is_module(name: str) -> bool:
  rel = Path(*name.split("."))
  return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
  if not node.level:
    return node.module or ""
  base = module.split(".") if is_package else module.split(".")[:-1]
  base = base[: len(base) - node.level + 1]
  return ".".join(base + ([node.module] if node.module else []))


def fastpos_imports(path: Path) -> list[tuple[int, str]]:
  """(line, fastpos module) for every import of a fastpos module in ``path``."""
  module = _module_name(path)
  tree = ast.parse(path.read_text(), str(path))
  found = []
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      target = _resolve_from(module, path.name == "__init__.py", node)
      # `from pkg import sub` imports the submodule pkg.sub when there is one.
      names = [
          f"{target}.{a.name}" if _is_module(f"{target}.{a.name}") else target for a in node.names
      ]
    elif (
        isinstance(node, ast.Call)
        and node.args
        and (
            getattr(node.func, "attr", None) == "import_module"
            or getattr(node.func, "id", None) in ("import_module", "__import__")
        )
    ):
      arg = node.args[0]
      if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        names = [arg.value]
      elif (
          isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant)
      ):
        names = [str(arg.values[0].value).rstrip(".")]  # the package the f-string names
    elif (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and _REGISTRY_STRING.fullmatch(node.value)
    ):
      names = [node.value.split(":")[0]]
    found += [(node.lineno, n) for n in names if n == "fastpos" or n.startswith("fastpos.")]
  return found


def _files() -> list[Path]:
  return sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


def violations(files) -> list[str]:
  bad = []
  for path in files:
    module = _module_name(path)
    layer = layer_of(module)
    for line, target in fastpos_imports(path):
      where = f"{path.relative_to(ROOT)}:{line}"
      if module in LEAVES:
        bad.append(f"{where}: {module} must import nothing of fastpos; imports {target}")
        continue
      target_layer = layer_of(target)
      if target_layer is None or target_layer in ALLOWED[layer]:
        continue
      if any(target == m or target.startswith(m + ".") for m in EXTRA.get(layer, ())):
        continue
      bad.append(
          f"{where}: {layer} ({module}) imports {target} ({target_layer}); {layer} may "
          f"import {', '.join(sorted(ALLOWED[layer] | EXTRA.get(layer, set())))}"
      )
  return bad


def test_no_layer_imports_upward():
  files = _files()
  assert len(files) > 30  # the walk found the package
  assert violations(files) == []


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            "from fastpos.models import build_model\n",
            "tasks (fastpos.tasks.bad) imports " "fastpos.models (models)",
        ),
        ("def f():\n  import fastpos.train.trainer\n", "imports fastpos.train.trainer (train)"),
        (
            "import importlib\nimportlib.import_module('fastpos.models.config')\n",
            "imports fastpos.models.config (models)",
        ),
        ("REGISTRY = {'x': 'fastpos.train.cli:main'}\n", "imports fastpos.train.cli (train)"),
    ],
)
def test_an_upward_import_is_reported(tmp_path, monkeypatch, source, expected):
  # The check itself: an upward import planted in a copy of the tree is found and named.
  fake = tmp_path / "fastpos"
  for name in ("models", "train", "tasks"):
    (fake / name).mkdir(parents=True)
    (fake / name / "__init__.py").write_text("")
  (fake / "models" / "config.py").write_text("")
  (fake / "train" / "trainer.py").write_text("")
  (fake / "train" / "cli.py").write_text("")
  bad = fake / "tasks" / "bad.py"
  bad.write_text(source)
  monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
  found = violations([bad])
  assert len(found) == 1 and expected in found[0], found


OUTSIDE = ("benchmarks", "scripts", "tests")
_IMPORTER = {"import_module", "__import__"}


def outside_imports(path: Path) -> list[tuple[int, str]]:
  """(line, module) for every import in ``path`` of the repository's ``benchmarks``,
  ``scripts`` or ``tests`` (not installed: the package must not need them)."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level:
      names = [node.module or ""]
    elif (
        isinstance(node, ast.Call)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and {getattr(node.func, "attr", None), getattr(node.func, "id", None)} & _IMPORTER
    ):
      names = [str(node.args[0].value)]
    found += [(node.lineno, n) for n in names if n.split(".")[0] in OUTSIDE]
  return found


def test_the_package_imports_no_benchmark_script_or_test():
  bad = [
      f"{path.relative_to(ROOT)}:{line}: imports {name}"
      for path in sorted(PACKAGE.rglob("*.py"))
      for line, name in outside_imports(path)
  ]
  assert bad == []


def test_an_import_of_the_benchmarks_is_reported(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text(
      "import os\ndef f():\n  from benchmarks import measure\n"
      "importlib.import_module('benchmarks.gpu')\n"
  )
  assert outside_imports(bad) == [(3, "benchmarks"), (4, "benchmarks.gpu")]


def test_models_import_only_the_task_info_of_tasks():
  # At run time too: building models pulls in no task module, and nothing of the trainer.
  code = (
      "import json, sys; import fastpos.models; "
      "print(json.dumps(sorted(m for m in sys.modules if m.startswith('fastpos'))))"
  )
  proc = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), timeout=120
  )
  assert proc.returncode == 0, proc.stderr
  modules = json.loads(proc.stdout)
  assert [m for m in modules if m.startswith("fastpos.tasks")] == [
      "fastpos.tasks",
      "fastpos.tasks.base",
      "fastpos.tasks.info",
  ]
  assert not [m for m in modules if m.startswith("fastpos.train")]


def test_schemes_import_no_sibling_scheme():
  # Shared math lives below the schemes (fastpos.ops, e.g. ops.rotations, positional.base, or
  # positional.path_keys, the keys of fixed draws): a scheme module imports no other scheme
  # module, nor the registry above it.
  from fastpos import positional

  allowed = {"fastpos.positional.base", "fastpos.positional.path_keys"}
  for module in positional.SCHEME_MODULES:
    path = PACKAGE / "positional" / f"{module}.py"
    bad = [
        (line, t)
        for line, t in fastpos_imports(path)
        if t.startswith("fastpos.positional") and t not in allowed
    ]
    assert bad == [], f"{path.relative_to(ROOT)} imports {bad}; may import {sorted(allowed)}"
