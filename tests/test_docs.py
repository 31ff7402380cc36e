"""README.md and docs/*.md say what is true: their commands run, their figures have sources.

* Fenced blocks name their language (``bash``, ``python`` or ``text``); a ``bash`` block that
  cannot run on a plain CPU checkout in seconds says what it needs on the line above its
  fence, ``<!-- needs: data, gpu -->`` (the valid needs: ``NEEDS``).
* Default run, cheap checks of every command: the script or module exists, its ``--flags``
  are defined in the code, ``--config=FILE[:ARGS]`` loads (every cell of a sweep's grid too),
  ``--config.<field>`` overrides and swept fields are declared; ``python`` blocks compile and
  their imports resolve.
* ``-m slow``: the unmarked ``bash`` blocks run, each script's ``--help`` lists the flags the
  documents give it, every ``train.py`` command prints its config, the ``python`` blocks run.
* A block (paragraph, list or table) quoting measured figures has ``<!-- source: FILE, ... -->``
  on the line above, and each of its figures appears in one of those files; a figure with a
  unit (%, s, GiB, x, ...) outside such a block fails (``<!-- estimate -->``: figures computed
  from shapes, not measured).
* A README section that code or docs cite by its quoted name is a heading of the README.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import importlib
import importlib.util
import itertools
import os
import re
import shlex
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
LANGS = ("bash", "python", "text")
NEEDS = {
    "data": "downloaded datasets",
    "gpu": "a GPU",
    "hosts": "several machines or a cluster",
    "network": "internet access",
    "tensorflow": "the separate tfds-preparation environment",
    "run": "a workdir trained by an earlier command",
    "long": "minutes or more",
}
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
# Programs a command may start that are not this repository's: not checked further.
EXTERNAL = ("pip", "ruff", "pyink", "cd", "export", "source", "cp", "srun", "gcloud")
# Flags every absl program has.
ABSL_FLAGS = {"help", "helpfull", "helpshort", "flagfile", "verbosity", "v", "logtostderr"}


@dataclasses.dataclass(frozen=True)
class Block:
  path: str
  line: int
  lang: str
  text: str
  needs: frozenset

  def where(self) -> str:
    return f"{self.path}:{self.line}"


def _read(path: str) -> str:
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    return f.read()


def _comment(line: str, key: str) -> str | None:
  m = re.fullmatch(rf"\s*<!--\s*{key}:?\s*(.*?)\s*-->\s*", line)
  return None if m is None else m.group(1)


def fenced_blocks(path: str) -> list[Block]:
  lines, out, i = _read(path).splitlines(), [], 0
  while i < len(lines):
    m = re.match(r"^```(.*)$", lines[i])
    if not m:
      i += 1
      continue
    start, lang = i, m.group(1).strip()
    j = i + 1
    while j < len(lines) and not lines[j].startswith("```"):
      j += 1
    k = start - 1  # the HTML comments right above the fence (a marker CI reads may sit between)
    while k >= 0 and lines[k].strip().startswith("<!--"):
      k -= 1
    given = [_comment(line, "needs") for line in lines[k + 1 : start]]
    needs = ",".join(n for n in given if n)
    out.append(
        Block(
            path,
            start + 1,
            lang,
            "\n".join(lines[start + 1 : j]),
            frozenset(n.strip() for n in (needs or "").split(",") if n.strip()),
        )
    )
    i = j + 1
  return out


def all_blocks(lang: str | None = None) -> list[Block]:
  return [b for p in DOCS for b in fenced_blocks(p) if lang is None or b.lang == lang]


# ---- shell commands -----------------------------------------------------------------------


def _lines(text: str) -> list[str]:
  """Logical lines: continuations joined, comments and blank lines dropped."""
  joined = re.sub(r"\\\n", " ", text)
  return [ln for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _segments(line: str) -> list[list[str]]:
  lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
  lex.whitespace_split, lex.commenters = True, "#"
  segs, cur = [], []
  for tok in lex:
    if tok in (";", "&&", "||", "|", "&"):
      segs.append(cur)
      cur = []
    else:
      cur.append(tok)
  return [s for s in segs + [cur] if s]


def commands(text: str) -> list[list[str]]:
  """The argv of every command of a bash block; ``for v in a b; do ...; done`` expanded."""
  out = []
  for line in _lines(text):
    loops: dict[str, list[str]] = {}
    for seg in _segments(line):
      if seg[0] == "for" and len(seg) > 3 and seg[2] == "in":
        loops[seg[1]] = seg[3:]
        continue
      if seg[0] == "done":
        continue
      if seg[0] == "do":
        seg = seg[1:]
      names = list(loops)
      for values in itertools.product(*(loops[n] for n in names)):
        argv = list(seg)
        for name, value in zip(names, values):
          argv = [a.replace(f"${name}", value) for a in argv]
        out.append(argv)
  return out


@dataclasses.dataclass
class Call:
  """One program of this repository a command runs: a script path or ``-m module``."""

  target: str
  args: list
  module: bool = False


def _is_python(tok: str) -> bool:
  return re.fullmatch(r"(.*/)?python3?", tok) is not None


def calls(argv: list[str]) -> tuple[list[Call], list[str]]:
  """(the repository programs ``argv`` runs, problems) after env assignments and wrappers."""
  while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
    argv = argv[1:]
  if not argv:
    return [], []
  prog = argv[0]
  if _is_python(prog):
    if argv[1:3] == ["-m", "venv"]:
      return [], []
    if len(argv) > 2 and argv[1] == "-m":
      return [Call(argv[2], argv[3:], module=True)], []
    return [Call(argv[1], argv[2:])], []
  if prog.startswith("scripts/") and prog.endswith(".sh"):
    if prog.endswith("launch_local.sh") and "--" in argv:
      k = argv.index("--")
      inner = argv[k + 1 :]
      inner_calls = [Call(inner[0], inner[1:])] if inner and inner[0].endswith(".py") else []
      nested, problems = ([], []) if inner_calls else calls(inner)
      return [Call(prog, argv[1:k])] + inner_calls + nested, problems
    return [Call(prog, argv[1:])], []
  if re.fullmatch(r"[A-Z_]+", prog):  # a placeholder for any command (COMMAND)
    return [], []
  if os.path.basename(prog) in EXTERNAL:
    found, problems = [], []
    for i, tok in enumerate(argv[1:], 1):
      if tok.startswith("--command="):
        for line in _lines(tok.split("=", 1)[1]):
          for seg in _segments(line):
            c, p = calls(seg)
            found, problems = found + c, problems + p
      elif _is_python(tok):
        c, p = calls(argv[i:])
        return found + c, problems + p
    return found, problems
  return [], [f"unknown program {prog!r} (not this repository's, not in EXTERNAL)"]


def _doc_commands() -> tuple[list[tuple[Block, Call]], list[str]]:
  """(block, call) for every repository program the documents' commands run, and problems."""
  out, problems = [], []
  for block in all_blocks("bash"):
    for argv in commands(block.text):
      found, why = calls(argv)
      problems += [f"{block.where()}: {w}" for w in why]
      out.extend((block, c) for c in found)
  return out, problems


# ---- what the code declares ----------------------------------------------------------------


def _sources() -> str:
  files = [os.path.join(ROOT, f) for f in ("train.py", "eval.py")]
  for folder in ("fastpos", "scripts", "benchmarks"):
    files += glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)
  files += glob.glob(os.path.join(ROOT, "scripts", "*.sh"))
  text = []
  for path in files:
    with open(path, encoding="utf-8") as f:
      text.append(f.read())
  return "\n".join(text)


_SOURCE_TEXT: list[str] = []


def defined_in_code(flag: str) -> bool:
  """Whether ``flag`` is defined somewhere in the programs' code (absl or argparse)."""
  if not _SOURCE_TEXT:
    _SOURCE_TEXT.append(_sources())
  return re.search(rf"[\"'](--)?{re.escape(flag)}[\"'=]", _SOURCE_TEXT[0]) is not None


def load_config(spec: str):
  """``get_config(arg)`` of ``configs/<x>.py[:arg]``: its task name, or raises."""
  path, _, arg = spec.partition(":")
  m = re.fullmatch(r"configs/(\w+)\.py", path)
  if m is None or not os.path.exists(os.path.join(ROOT, path)):
    raise ValueError(f"--config={spec}: no config file {path}")
  module = importlib.import_module(f"configs.{m.group(1)}")
  return module.get_config(arg or None)


def check_field(path: str, task: str) -> str | None:
  """None when ``path`` is a field a config can set, else why not."""
  from fastpos import config_schema

  parts = path.split(".")
  if parts[:2] == ["model", "positional_options"] and len(parts) == 4:
    from fastpos import positional

    try:
      spec = positional.get_class(parts[2]).option_spec
    except Exception as e:  # noqa: BLE001  (the message is what the test reports)
      return f"{path}: {e}"
    return None if parts[3] in spec else f"{path}: not an option of {parts[2]}"
  return None if config_schema.field(path, task) is not None else f"{path}: not a config field"


def _script_path(call: Call) -> str:
  if call.module:
    return call.target.replace(".", "/")
  return call.target


def _check_flags(call: Call) -> tuple[list[str], str | None, list[str]]:
  """The call's undefined flags (as problems), its --config spec and its overrides."""
  problems, spec, grid = [], None, []
  for arg in call.args:
    if arg == "--":
      break
    if not arg.startswith("-"):
      if re.fullmatch(r"[\w.]+=.+", arg) and call.target.startswith("scripts/sweep"):
        grid.append(arg)
      continue
    name, _, value = arg.lstrip("-").partition("=")
    if name == "config":
      spec = value
    elif name.startswith(("config.", "noconfig.")):
      grid.append(f"{name.split('.', 1)[1]}={value}")
    elif not (defined_in_code(name) or name in ABSL_FLAGS):
      problems.append(f"{call.target}: flag --{name} is not defined in the code")
  return problems, spec, grid


def _benchmark_name(call: Call) -> str | None:
  """NAME of ``python -m benchmarks NAME ...`` (None for any other call)."""
  if call.module and call.target == "benchmarks" and call.args:
    name = call.args[0]
    # --help lists the benchmarks; NAME (capitals) stands for any of them.
    return None if name.startswith("-") or re.fullmatch(r"[A-Z_]+", name) else name
  return None


def check_call(call: Call) -> list[str]:
  """Problems with one program call: its file, flags, config and overrides."""
  if call.module:
    if call.target in ("pytest", "venv"):
      return []
    if importlib.util.find_spec(call.target) is None:
      return [f"no module {call.target}"]
    if call.target == "benchmarks":
      from benchmarks import BENCHMARKS

      name = _benchmark_name(call)
      if name is not None and name not in BENCHMARKS:
        return [f"python -m benchmarks {name}: not a benchmark ({', '.join(BENCHMARKS)})"]
  elif not os.path.exists(os.path.join(ROOT, call.target)):
    return [f"no script {call.target}"]
  problems, spec, grid = _check_flags(call)
  if spec is None or spec.endswith(".json") or not spec.startswith("configs/"):
    return problems + ([f"{call.target}: overrides without --config"] if grid and not spec else [])
  base, _, arg = spec.partition(":")
  swept = [g.split("=", 1) for g in grid if g.startswith("arg.")]
  cells = itertools.product(*([f"{k[4:]}={v}" for v in vs.split(",")] for k, vs in swept))
  for cell in cells:
    cell_spec = base + ":" + ",".join([a for a in (arg,) if a] + list(cell))
    try:
      cfg = load_config(cell_spec.rstrip(":"))
    except Exception as e:  # noqa: BLE001
      problems.append(f"{call.target}: --config={cell_spec}: {type(e).__name__}: {e}")
      continue
    for g in grid:
      if not g.startswith("arg."):
        why = check_field(g.split("=", 1)[0], cfg.task.name)
        problems += [f"{call.target}: {why}"] if why else []
  return problems


def test_every_fence_names_its_language_and_needs_are_known():
  bad = [
      f"{b.where()}: language {b.lang!r} (use one of {LANGS})"
      for b in all_blocks()
      if b.lang not in LANGS
  ]
  bad += [
      f"{b.where()}: unknown needs {sorted(b.needs - set(NEEDS))} (valid: {sorted(NEEDS)})"
      for b in all_blocks()
      if b.needs - set(NEEDS)
  ]
  bad += [
      f"{b.where()}: needs on a {b.lang} block"
      for b in all_blocks()
      if b.needs and b.lang != "bash"
  ]
  assert not bad, "\n".join(bad)


def test_the_test_command_is_where_ci_reads_it():
  lines = _read("README.md").splitlines()
  k = lines.index("<!-- test-command -->")
  assert lines[k + 1] == "```bash" and lines[k + 3] == "```"
  assert lines[k + 2].startswith(".venv/bin/python -m pytest")
  block = next(b for b in fenced_blocks("README.md") if b.line == k + 2)
  assert "long" in block.needs  # the whole suite: never run by the slow documents test


def test_commands_name_existing_scripts_flags_and_configs():
  found, problems = _doc_commands()
  checked = 0
  for block, call in found:
    problems += [f"{block.where()}: {p}" for p in check_call(call)]
    checked += 1
  assert checked > 30  # the parser saw the documents' commands
  assert not problems, "\n".join(problems)


_INLINE = re.compile(r"`((?:\.venv/bin/)?python3? [^`]+|scripts/\w+\.sh(?: [^`]*)?)`")


def test_inline_commands_name_existing_scripts_and_flags():
  problems, checked = [], 0
  for path in DOCS:
    for m in _INLINE.finditer(_read(path)):
      found, why = calls(shlex.split(m.group(1)))
      problems += [f"{path}: {m.group(1)!r}: {w}" for w in why]
      for call in found:
        problems += [f"{path}: {m.group(1)!r}: {p}" for p in check_call(call)]
        checked += 1
  assert checked >= 8
  assert not problems, "\n".join(problems)


def test_python_blocks_compile_and_their_imports_resolve():
  blocks = all_blocks("python")
  assert blocks
  problems = []
  for b in blocks:
    tree = compile(b.text, b.where(), "exec", ast.PyCF_ONLY_AST)
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module:
        module = importlib.import_module(node.module)
        problems += [
            f"{b.where()}: {node.module}.{a.name} does not exist"
            for a in node.names
            if not hasattr(module, a.name)
        ]
      elif isinstance(node, ast.Import):
        problems += [
            f"{b.where()}: no module {a.name}"
            for a in node.names
            if importlib.util.find_spec(a.name) is None
        ]
  assert not problems, "\n".join(problems)


def test_the_command_parser_sees_loops_wrappers_and_launchers():
  argv = commands("for t in a b; do scripts/sweep.sh --config=configs/x.py:task=$t; done")
  assert argv == [
      ["scripts/sweep.sh", "--config=configs/x.py:task=a"],
      ["scripts/sweep.sh", "--config=configs/x.py:task=b"],
  ]
  found, _ = calls(["X=1", "scripts/launch_local.sh", "2", "--", "train.py", "--workdir=w"])
  assert [c.target for c in found] == ["scripts/launch_local.sh", "train.py"]
  found, _ = calls(["gcloud", "ssh", "--command=cd f && .venv/bin/python eval.py --workdir=w"])
  assert [c.target for c in found] == ["eval.py"]
  assert calls(["frobnicate"])[1]
  assert check_call(Call("train.py", ["--no_such_flag_here=1"]))
  assert check_call(Call("benchmarks", ["no_such_benchmark", "--out=x"], module=True))
  assert not check_call(Call("benchmarks", ["decode", "--out=x"], module=True))
  assert check_call(Call("train.py", ["--config=configs/listops_generated.py:kernel=nope"]))
  assert check_call(
      Call("train.py", ["--config=configs/listops_generated.py", "--config.model.no_field=1"])
  )


# ---- figures and their sources ---------------------------------------------------------------

# A number not inside a word or a version (0.10.2); a ratio's "x" may follow it.
_NUMBER = r"(?<![\w.])(\d+(?:,\d{3})+|\d+)(\.\d+)?(e-?\d+)?(?!\.\d|[^\Wx])"
_UNIT = r"(%|x\b|\s?(?:ms|s|min|GiB|MiB|KiB|GB|MB|KB)\b|\s(?:tokens|steps)/s\b)"
_FIGURE = re.compile(_NUMBER + _UNIT + "?")


def _value(m: re.Match) -> float:
  return float(m.group(1).replace(",", "") + (m.group(2) or "") + (m.group(3) or ""))


def figures(text: str) -> list[tuple[str, float, bool]]:
  """(figure as written, value, has a unit) for each figure of prose ``text``: a number with
  a decimal point, a thousands separator, an exponent or a unit."""
  text = re.sub(r"`[^`]*`", " ", text)
  text = re.sub(r"<!--.*?-->", " ", text)
  text = re.sub(r"\]\([^)]*\)", "]", text)
  out = []
  for m in _FIGURE.finditer(text):
    unit = m.group(4) is not None
    if unit or m.group(2) or m.group(3) or "," in m.group(1):
      out.append((m.group(0), _value(m), unit))
  return out


def source_numbers(path: str) -> set[float]:
  return {_value(m) for m in re.finditer(_NUMBER, _read(path))}


def prose_blocks(path: str) -> list[tuple[int, str, str | None]]:
  """(line, text, source) of each paragraph / list / table outside fences; ``source`` is the
  ``<!-- source: -->`` (or ``estimate``) comment on the line above, else None."""
  out, cur, src, start, fence = [], [], None, 0, False
  for n, line in enumerate(_read(path).splitlines(), 1):
    if line.startswith("```"):
      fence = not fence
      continue
    if fence:
      continue
    given = _comment(line, "source")
    if given is None and _comment(line, "estimate") is not None:
      given = "estimate"
    if not line.strip() or given is not None:
      if cur:
        out.append((start, "\n".join(cur), src))
      cur, src, start = [], given, n + 1
      continue
    cur.append(line)
  if cur:
    out.append((start, "\n".join(cur), src))
  return out


def _rows(text: str, files: list[str]) -> list[tuple[str, list[str]]]:
  """(text, its sources): a table row naming one of ``files`` in a cell is held to that file
  alone; the rest of the block to all of ``files``."""
  out = []
  for row in text.splitlines():
    cells = [c.strip().strip("`") for c in row.strip().strip("|").split("|")]
    named = [c for c in cells if c in files] if row.lstrip().startswith("|") else []
    out.append((row, named or files))
  return out


def test_figures_come_from_their_sources():
  problems, sourced = [], 0
  for path in DOCS:
    for line, text, src in prose_blocks(path):
      if src is None or src == "estimate":
        continue
      files = [f.strip() for f in src.split(",")]
      missing = [f for f in files if not os.path.isfile(os.path.join(ROOT, f))]
      if missing:
        problems.append(f"{path}:{line}: source {missing} does not exist")
        continue
      sourced += 1
      for part, part_files in _rows(text, files):
        known = set().union(*(source_numbers(f) for f in part_files))
        problems += [
            f"{path}:{line}: {shown!r} is not in {', '.join(part_files)}"
            for shown, value, _ in figures(part)
            if value not in known
        ]
  assert sourced >= 10
  assert not problems, "\n".join(problems)


def test_measured_figures_are_not_quoted_without_a_source():
  problems = [
      f"{path}:{line}: {shown!r} has a unit but its block has no <!-- source: --> comment"
      for path in DOCS
      for line, text, src in prose_blocks(path)
      if src is None
      for shown, _, unit in figures(text)
      if unit
  ]
  assert not problems, "\n".join(problems)


def test_the_figure_reader_tells_figures_from_other_numbers():
  found = [
      f[0]
      for f in figures(
          "v0.10.2, 2-core, 4 x 128, `1.5 s`, 38.8% and 1,048,576, 3.19x, 7.96 GiB, 2.8e-07"
      )
  ]
  assert found == ["38.8%", "1,048,576", "3.19x", "7.96 GiB", "2.8e-07"]


def test_a_table_row_naming_its_file_is_held_to_that_file():
  rows = _rows("Prose 1.5 s.\n| a | 2.5 s | `b.md` |", ["a.md", "b.md"])
  assert [files for _, files in rows] == [["a.md", "b.md"], ["b.md"]]


def test_readme_sections_cited_in_code_and_docs_exist():
  prose = re.sub(r"^```.*?^```", "", _read("README.md"), flags=re.MULTILINE | re.DOTALL)
  headings = {m.group(1).strip() for m in re.finditer(r"^#+\s+(.+)$", prose, re.MULTILINE)}
  assert {"Quick start", "Design", "Data"} <= headings
  files = [
      os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)
  ]
  files = [f for f in files if not f.startswith((".venv", "build"))] + DOCS[1:]
  problems = []
  for path in files:
    text = re.sub(r"\s+", " ", _read(path))
    for m in re.finditer(r"README(?:'s)?,? \(?\"([^\"]+)\"", text):
      if m.group(1) not in headings:
        problems.append(f"{path}: README section {m.group(1)!r} is not a heading of README.md")
  text = re.sub(r"\s+", " ", prose)
  problems += [
      f"README.md: see {m.group(1)!r}: no such heading"
      for m in re.finditer(r"\bsee \"([^\"]+)\"", text)
      if m.group(1) not in headings
  ]
  assert not problems, "\n".join(problems)


def test_paths_the_documents_name_exist():
  roots = ("fastpos/", "configs/", "scripts/", "tests/", "benchmarks/", "results/", "docs/")
  built = ("docs/api",)  # written by scripts/build_docs.sh, not committed
  problems = []
  for path in DOCS:
    text = _read(path)
    named = re.findall(r"`([\w./-]+)`", text) + re.findall(r"\]\(([\w./-]+)\)", text)
    for name in named:
      name = name.split(":")[0]
      if name.rstrip("/") in built:
        continue
      if name.startswith(roots) and not os.path.exists(os.path.join(ROOT, name)):
        problems.append(f"{path}: {name} does not exist")
  assert not problems, "\n".join(problems)


# ---- slow: run them -----------------------------------------------------------------------


def _env(tmp_path) -> dict:
  env = dict(os.environ)
  env["PATH"] = os.path.dirname(PYTHON) + os.pathsep + env.get("PATH", "")
  env["FASTPOS_CACHE_DIR"] = str(tmp_path / "cache")
  env.pop("PYTEST_CURRENT_TEST", None)
  env.pop("PYTEST_XDIST_WORKER", None)
  return env


def _run(cmd, tmp_path, timeout=600, shell=False) -> subprocess.CompletedProcess:
  return subprocess.run(
      cmd,
      cwd=ROOT,
      env=_env(tmp_path),
      capture_output=True,
      text=True,
      timeout=timeout,
      shell=shell,
      executable="/bin/bash" if shell else None,
  )


_RUNNABLE = [b for b in all_blocks("bash") if not b.needs]


@pytest.mark.slow
@pytest.mark.parametrize("block", _RUNNABLE, ids=[b.where() for b in _RUNNABLE])
def test_unmarked_bash_blocks_run(block, tmp_path):
  text = block.text.replace("/tmp/", f"{tmp_path}/")
  r = _run("set -euo pipefail\n" + text, tmp_path, shell=True)
  assert r.returncode == 0, f"{block.where()} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def _help_targets() -> dict[str, set]:
  flags: dict[str, set] = {}
  for _, call in _doc_commands()[0]:
    if call.module and call.target in ("pytest", "venv"):
      continue
    names = {
        a.lstrip("-").split("=")[0]
        for a in itertools.takewhile(lambda a: a != "--", call.args)
        if a.startswith("--") and not a.startswith(("--config.", "--noconfig."))
    }
    target = _script_path(call) if not call.module else call.target
    if _benchmark_name(call):  # one command, a benchmark per name: each its own --help
      target = f"{call.target} {_benchmark_name(call)}"
    flags.setdefault(target, set()).update(names)
  return flags


@pytest.mark.slow
def test_each_script_help_lists_the_flags_the_documents_give_it(tmp_path):
  problems = []
  for target, names in sorted(_help_targets().items()):
    if target.endswith(".sh"):
      cmd = [os.path.join(ROOT, target), "--help"]
    elif "/" in target or target.endswith(".py"):
      cmd = [PYTHON, target, "--helpfull" if target in ("train.py", "eval.py") else "--help"]
    else:
      cmd = [PYTHON, "-m", *target.split(), "--help"]
    r = _run(cmd, tmp_path, timeout=120)
    text = r.stdout + r.stderr
    if "--helpfull" not in cmd and "helpfull" in text:  # an absl program: all its flags
      r = _run(cmd[:-1] + ["--helpfull"], tmp_path, timeout=120)
      text = r.stdout + r.stderr
    problems += [
        f"{target}: --help does not list --{n}" for n in sorted(names) if f"-{n}" not in text
    ]
  assert not problems, "\n".join(problems)


def _train_calls() -> list[Call]:
  seen, out = set(), []
  for _, call in _doc_commands()[0]:
    if call.target == "train.py" and any(a.startswith("--config=configs/") for a in call.args):
      key = tuple(a for a in call.args if a.startswith("--config"))
      if key not in seen:
        seen.add(key)
        out.append(Call("train.py", list(key)))
  return out


@pytest.mark.slow
@pytest.mark.parametrize("call", _train_calls(), ids=lambda c: " ".join(c.args)[:80])
def test_train_commands_print_their_config(call, tmp_path):
  r = _run([PYTHON, "train.py", *call.args, "--print_config"], tmp_path, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]


_PY = all_blocks("python")


@pytest.mark.slow
@pytest.mark.parametrize("block", _PY, ids=[b.where() for b in _PY])
def test_python_blocks_run(block, tmp_path):
  r = _run([PYTHON, "-c", block.text], tmp_path, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
