"""LRA ListOps: vocabulary, reference evaluator, seeded generator, LRA TSV reader, the task.

ListOps (Nangia & Bowman 2018) in the Long Range Arena's long form (Tay et al. 2021): nested
prefix expressions over the digits 0-9 with ``[MIN``, ``[MAX``, ``[MED`` (LRA's
``int(np.median(args))``: ``[MED 2 5 ]`` is 3) and ``[SM`` (sum modulo 10), each closed by
``]``; the label is the expression's value (10 classes). ``load_split`` reads either ``generate``'s
seeded draws from LRA's tree distribution or the LRA release's TSVs (``python
scripts/download_data.py listops``; in ``tsv_dir(DIR)`` = ``DIR/lra_release/listops-1000/``,
96,000 / 2,000 / 2,000 rows); ``ListOpsTask`` maps ``config.task`` onto it for the trainer.

The release writes each expression as LRA's binary tuple tree, every pair in parentheses::

    [MAX 2 9 [MIN 4 7 ] 0 ]   is written   ( ( ( ( ( [MAX 2 ) 9 ) ( ( ( [MIN 4 ) 7 ) ] ) ) 0 ) ] )

The parentheses carry nothing and triple the length (LRA's generator counted lengths without
them, so the files run to ~6000 tokens for a nominal 2000; google-research/long-range-arena
issues #6, #20). ``parens=False`` (default) is LRA's fixed task: ``]`` is a token, the
parentheses are dropped and lengths count what the model sees; ``parens=True`` keeps the
release form. ``encode`` / ``decode`` / ``evaluate`` accept both.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterator, Sequence

import ml_collections
import numpy as np
from absl import logging

from fastpos import fields
from fastpos.tasks import base, paths
from fastpos.tasks.info import TaskInfo

PAD = "<pad>"
DIGITS = tuple(str(d) for d in range(10))
# Order matters: it is the operator code used by the generator (MIN, MAX, MED, SUM_MOD).
OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
CLOSE = "]"
OPEN_PAREN = "("
CLOSE_PAREN = ")"
VOCAB: tuple[str, ...] = (PAD,) + DIGITS + OPERATORS + (CLOSE, OPEN_PAREN, CLOSE_PAREN)

NUM_CLASSES = 10
SPLITS = ("train", "validation", "test")
SOURCES = ("generated", "tsv")
ON_OVERFLOW = base.ON_OVERFLOW
# LRA release files per split (header ``Source<TAB>Target``, rows written by csv.writer, so
# lines end in CRLF) and their sizes.
TSV_FILES = {"train": "basic_train.tsv", "validation": "basic_val.tsv", "test": "basic_test.tsv"}
LRA_SIZES = {"train": 96000, "validation": 2000, "test": 2000}
TSV_HEADER = ("Source", "Target")
# Folder of the TSVs in the unpacked LRA release, under the data root's lra_release/.
LISTOPS_SUBDIR = "listops-1000"

OP_PROB = 0.25  # LRA: a node above max_depth is an operator with probability 1/4
# A generator call gives up after this many trees in a row fell outside the length window.
MAX_CONSECUTIVE_REJECTIONS = 100_000
CACHE_VERSION = 1
_BATCH_TREES = 256  # trees drawn per vectorised batch

_TOKEN_ID = {tok: i for i, tok in enumerate(VOCAB) if tok != PAD}
_VOCAB_ARRAY = np.array(VOCAB, dtype=object)
_DIGIT_ID0 = VOCAB.index("0")
_OP_ID0 = VOCAB.index(OPERATORS[0])
_CLOSE_ID = VOCAB.index(CLOSE)
_OPEN_PAREN_ID = VOCAB.index(OPEN_PAREN)
_CLOSE_PAREN_ID = VOCAB.index(CLOSE_PAREN)
_DIGIT_VALUE = {d: i for i, d in enumerate(DIGITS)}

# Fast encoder: each multi-character token becomes one lower-case letter (absent from valid
# input), then the single spaced characters are mapped by a byte table.
_FAST_REPLACE = tuple((op, chr(ord("a") + i)) for i, op in enumerate(OPERATORS))
_BYTE_TABLE = np.full(256, -1, np.int32)
for _tok, _i in _TOKEN_ID.items():
  _c = dict(_FAST_REPLACE).get(_tok, _tok)
  if len(_c) == 1:
    _BYTE_TABLE[ord(_c)] = _i
del _tok, _i, _c


def tsv_dir(data_dir: str | os.PathLike | None) -> str:
  """The folder of the LRA ListOps TSVs under the data root ``data_dir`` (``paths.data_root``):
  ``<root>/lra_release/listops-1000/``, where ``scripts/download_data.py listops`` puts them."""
  return paths.task_path(data_dir, paths.LRA_SUBDIR, LISTOPS_SUBDIR)


def _missing(path: str) -> FileNotFoundError:
  """``paths.missing_data`` for a ListOps TSV. When the file's folder is the data root's
  ``lra_release/listops-1000/`` the command names that root; otherwise the file was looked for
  outside the layout and the message says where the command puts the files."""
  folder = os.path.dirname(os.path.abspath(path))
  parent, leaf = os.path.split(folder)
  root, lra = os.path.split(parent)
  if leaf == LISTOPS_SUBDIR and lra == paths.LRA_SUBDIR:
    return paths.missing_data("listops", path, root, "an LRA ListOps file")
  return paths.missing_data(
      "listops",
      path,
      folder,
      f"an LRA ListOps file; the command puts {', '.join(TSV_FILES.values())} in "
      f"{tsv_dir(folder)}, so pass that folder or use the task's data_dir",
  )


# ------------------------------------------------------------------------ tokens


def _encode_slow(expr: str) -> np.ndarray:
  tokens = expr.split()
  for pos, tok in enumerate(tokens):
    if tok not in _TOKEN_ID:
      raise ValueError(
          f"unknown ListOps token {tok!r} at position {pos} (token index); valid "
          f"tokens: {' '.join(VOCAB[1:])}."
      )
  return np.asarray([_TOKEN_ID[t] for t in tokens], np.int32)


def encode(expr: str) -> np.ndarray:
  """Token ids of a whitespace-separated expression, int32 ``[num_tokens]`` (0 is never used).

  Raises ValueError naming the first unknown token and its position (token index).
  """
  if not isinstance(expr, str):
    raise ValueError(f"encode expects a str, got {type(expr).__name__}.")
  s = " ".join(expr.split())
  # Fast path (C-speed string ops + one table lookup); any doubt goes to the exact slow path.
  if s.isascii() and s.upper() == s:
    for tok, c in _FAST_REPLACE:
      s = s.replace(tok, c)
    b = np.frombuffer(s.encode("ascii"), np.uint8)
    if b.size % 2 == 1 and np.all(b[1::2] == ord(" ")):
      ids = _BYTE_TABLE[b[0::2]]
      if ids.size == 0 or ids.min() > 0:
        return ids
    elif b.size == 0:
      return np.zeros((0,), np.int32)
  return _encode_slow(expr)


def decode(ids: Sequence[int] | np.ndarray) -> str:
  """The expression of token ids ``[length]``; trailing padding (id 0) is dropped.

  Raises ValueError for ids outside the vocabulary or padding followed by a real token.
  """
  ids = np.asarray(ids)
  if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
    raise ValueError(
        f"decode expects a 1-D integer sequence, got dtype {ids.dtype} and shape " f"{ids.shape}."
    )
  bad = np.nonzero((ids < 0) | (ids >= len(VOCAB)))[0]
  if bad.size:
    raise ValueError(
        f"token id {int(ids[bad[0]])} at position {int(bad[0])} is outside the "
        f"vocabulary (valid ids: 0..{len(VOCAB) - 1})."
    )
  real = np.nonzero(ids)[0]
  n = int(real[-1]) + 1 if real.size else 0
  inner_pad = np.nonzero(ids[:n] == 0)[0]
  if inner_pad.size:
    raise ValueError(
        f"padding id 0 at position {int(inner_pad[0])} comes before a real token "
        f"(padding may only trail)."
    )
  return " ".join(_VOCAB_ARRAY[ids[:n]])


# --------------------------------------------------------------------- evaluator


def _apply(op: str, args: list[int]) -> int:
  if op == "[MIN":
    return min(args)
  if op == "[MAX":
    return max(args)
  if op == "[MED":
    s = sorted(args)
    n = len(s)
    return (s[(n - 1) // 2] + s[n // 2]) // 2  # = int(np.median(args)) for digits
  return sum(args) % 10  # [SM


def evaluate(expr: str) -> int:
  """The value 0..9 of an expression (paren-free or LRA release form).

  Iterative (an explicit stack), so any depth and length are fine. Parentheses must balance and
  are otherwise ignored. Raises ValueError for an unknown token, an operator without arguments,
  an unclosed operator, a stray ``]`` or tokens after the end of the expression.
  """
  tokens = expr.split()
  if not tokens:
    raise ValueError("cannot evaluate an empty expression.")
  stack: list[tuple[str, list[int]]] = []
  result: int | None = None
  parens = 0
  for pos, tok in enumerate(tokens):
    if tok == OPEN_PAREN:
      parens += 1
      continue
    if tok == CLOSE_PAREN:
      parens -= 1
      if parens < 0:
        raise ValueError(f"unbalanced ')' at position {pos} in {expr[:80]!r}.")
      continue
    if result is not None:
      raise ValueError(f"token {tok!r} at position {pos} follows the end of the expression.")
    if tok in _DIGIT_VALUE:
      value = _DIGIT_VALUE[tok]
    elif tok in OPERATORS:
      stack.append((tok, []))
      continue
    elif tok == CLOSE:
      if not stack:
        raise ValueError(f"']' at position {pos} closes no operator.")
      op, args = stack.pop()
      if not args:
        raise ValueError(f"operator {op!r} closed at position {pos} has no arguments.")
      value = _apply(op, args)
    else:
      raise ValueError(
          f"unknown ListOps token {tok!r} at position {pos}; valid tokens: "
          f"{' '.join(VOCAB[1:])}."
      )
    if stack:
      stack[-1][1].append(value)
    else:
      result = value
  if stack:
    raise ValueError(f"{len(stack)} operator(s) not closed by ']' at the end of the expression.")
  if parens:
    raise ValueError(f"{parens} '(' not closed at the end of the expression.")
  return result


# --------------------------------------------------------------------- generator


def _check_int(name: str, value, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
  return int(value)


def _longest(max_depth: int, max_args: int, parens: bool) -> int:
  """Tokens of the fullest tree (every node above max_depth an operator with max_args)."""
  ops = sum(max_args**d for d in range(max_depth - 1))
  tokens = 2 * ops + max_args ** (max_depth - 1)
  return 3 * tokens - 2 if parens else tokens


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
  c = np.cumsum(x)
  return c - x


def _sample_forest(
    rng: np.random.Generator,
    num_trees: int,
    *,
    max_depth: int,
    max_args: int,
    parens: bool,
    force_op_root: bool,
    min_tokens: int,
    max_tokens: int,
) -> list[tuple[np.ndarray, int]]:
  """Draws ``num_trees`` trees of LRA's distribution and returns, in draw order, those whose
  token count is in ``[min_tokens, max_tokens]`` as (token ids ``[length]``, value).

  The trees grow together level by level (breadth first, vectorised over every node of the
  level): the children of a level's operators, in order, are the next level, so the nodes of a
  tree stay contiguous and in tree order on every level. A tree stops growing once it is certain
  to exceed ``max_tokens``. Values, subtree sizes and token positions of the kept trees are then
  computed level by level with segment reductions, and the ids are written in place.
  """
  levels = []  # per level: tree [n], is_op [n], nargs [ops], op_code [ops], digit [n - ops]
  tree = np.arange(num_trees)
  tokens = np.zeros(num_trees, np.int64)
  alive = np.ones(num_trees, bool)
  for depth in range(1, max_depth + 1):
    n = tree.size
    if depth < max_depth:
      is_op = rng.random(n) < OP_PROB
      if depth == 1 and force_op_root:
        is_op[:] = True
    else:
      is_op = np.zeros(n, bool)
    n_ops = int(is_op.sum())
    nargs = rng.integers(2, max_args + 1, size=n_ops)
    op_code = rng.integers(0, len(OPERATORS), size=n_ops)
    digit = rng.integers(0, 10, size=n - n_ops)
    levels.append((tree, is_op, nargs, op_code, digit))
    op_tree = tree[is_op]
    own = np.where(is_op, 2, 1)  # an operator's own tokens: OP and ]
    if parens:  # k + 1 "(", k + 1 ")"
      own[is_op] += 2 * nargs + 2
    tokens += np.bincount(tree, weights=own, minlength=num_trees).astype(np.int64)
    pending = np.bincount(op_tree, weights=nargs, minlength=num_trees).astype(np.int64)
    alive &= tokens + pending <= max_tokens  # every pending node adds at least one token
    grow = np.where(alive[op_tree], nargs, 0)
    tree = np.repeat(op_tree, grow)
    if tree.size == 0:
      break
  keep = alive & (tokens >= min_tokens)
  if not keep.any():
    return []

  # Keep the accepted trees only (whole trees, so every kept operator keeps all its children).
  kept = []
  for tree, is_op, nargs, op_code, digit in levels:
    node_keep = keep[tree]
    op_keep = keep[tree[is_op]]
    kept.append((is_op[node_keep], nargs[op_keep], op_code[op_keep], digit[keep[tree[~is_op]]]))
    if not node_keep.any():
      kept.pop()
      break

  # Bottom-up: value and token count of every node.
  child_val = child_size = None
  per_level = []
  for is_op, nargs, op_code, digit in reversed(kept):
    val = np.empty(is_op.size, np.int64)
    size = np.empty(is_op.size, np.int64)
    val[~is_op] = digit
    size[~is_op] = 1
    starts = inner = None
    if nargs.size:
      starts = _exclusive_cumsum(nargs)
      # Arguments sorted within each operator: segments are contiguous and in order, so one
      # sort of (operator index, digit) keys does it.
      seg = np.repeat(np.arange(nargs.size), nargs)
      srt = np.sort(seg * 10 + child_val) - seg * 10
      med = (srt[starts + (nargs - 1) // 2] + srt[starts + nargs // 2]) // 2
      candidates = np.stack(
          [srt[starts], srt[starts + nargs - 1], med, np.add.reduceat(child_val, starts) % 10]
      )
      val[is_op] = candidates[op_code, np.arange(nargs.size)]
      inner = np.add.reduceat(child_size, starts)
      size[is_op] = inner + (2 * nargs + 4 if parens else 2)
    per_level.append((val, size, starts, inner, child_size))
    child_val, child_size = val, size
  per_level.reverse()

  # Top-down: first token position of every node in one buffer of all kept trees, then the ids.
  root_size = per_level[0][1]
  root_start = _exclusive_cumsum(root_size)
  ids = np.zeros(int(root_size.sum()), np.int32)
  start = root_start
  for (is_op, nargs, op_code, digit), (_, size, starts, inner, csize) in zip(kept, per_level):
    ids[start[~is_op]] = _DIGIT_ID0 + digit
    if not nargs.size:
      break
    s = start[is_op]
    end = s + size[is_op]
    # Tokens of the earlier siblings of every child.
    within = _exclusive_cumsum(csize) - np.repeat(_exclusive_cumsum(inner), nargs)
    if parens:
      # ( ( ... ( [OP a1 ) a2 ) ... ak ) ] )   with k + 1 opening parentheses.
      opens = np.repeat(s, nargs + 1) + (
          np.arange(int((nargs + 1).sum())) - np.repeat(_exclusive_cumsum(nargs + 1), nargs + 1)
      )
      ids[opens] = _OPEN_PAREN_ID
      ids[s + nargs + 1] = _OP_ID0 + op_code
      j = np.arange(csize.size) - np.repeat(starts, nargs)  # child index within its operator
      child_start = np.repeat(s + nargs + 2, nargs) + within + j
      ids[child_start + csize] = _CLOSE_PAREN_ID
      ids[end - 2] = _CLOSE_ID
      ids[end - 1] = _CLOSE_PAREN_ID
    else:
      ids[s] = _OP_ID0 + op_code
      child_start = np.repeat(s + 1, nargs) + within
      ids[end - 1] = _CLOSE_ID
    start = child_start
  if ids.min() <= 0:
    raise RuntimeError("internal error: the ListOps generator left a token position unfilled.")
  pieces = np.split(ids, root_start[1:])
  return list(zip(pieces, per_level[0][0].tolist()))


def _check_generate_args(
    num_examples, seed, min_length, max_length, max_depth, max_args, parens
) -> None:
  _check_int("num_examples", num_examples, 0)
  _check_int("seed", seed, 0)
  _check_int("min_length", min_length, 1)
  _check_int("max_length", max_length, 1)
  _check_int("max_depth", max_depth, 1)
  _check_int("max_args", max_args, 2)
  if not isinstance(parens, bool):
    raise ValueError(f"parens must be True or False, got {parens!r}.")
  if min_length > max_length:
    raise ValueError(f"min_length={min_length} exceeds max_length={max_length}.")
  shortest = 1 if min_length <= 1 or max_depth == 1 else (10 if parens else 4)
  longest = _longest(max_depth, max_args, parens)
  if max_length < shortest or min_length > longest:
    raise ValueError(
        f"no ListOps tree with max_depth={max_depth}, max_args={max_args} (parens={parens}) has "
        f"between {min_length} and {max_length} tokens: possible lengths are {shortest}.."
        f"{longest}."
    )


def _generate_ids(
    num_examples: int,
    *,
    seed: int,
    min_length: int,
    max_length: int,
    max_depth: int,
    max_args: int,
    parens: bool,
) -> list[tuple[np.ndarray, int]]:
  _check_generate_args(num_examples, seed, min_length, max_length, max_depth, max_args, parens)
  rng = np.random.default_rng(seed)
  out: list[tuple[np.ndarray, int]] = []
  rejected = 0
  while len(out) < num_examples:
    # A fixed batch size keeps generate(n) a prefix of generate(m > n) for the same seed.
    trees = _sample_forest(
        rng,
        _BATCH_TREES,
        max_depth=max_depth,
        max_args=max_args,
        parens=parens,
        force_op_root=min_length > 1,
        min_tokens=min_length,
        max_tokens=max_length,
    )
    if not trees:
      rejected += _BATCH_TREES
      if rejected >= MAX_CONSECUTIVE_REJECTIONS:
        raise ValueError(
            f"{rejected} ListOps trees in a row fell outside the length window [{min_length}, "
            f"{max_length}] (max_depth={max_depth}, max_args={max_args}, parens={parens}); "
            f"widen the window or change the tree limits."
        )
      continue
    rejected = 0
    out.extend(trees[: num_examples - len(out)])
  return out


def generate(
    num_examples: int,
    *,
    seed: int,
    min_length: int = 500,
    max_length: int = 2000,
    max_depth: int = 10,
    max_args: int = 10,
    parens: bool = False,
) -> list[tuple[str, int]]:
  """``num_examples`` (expression, value) pairs drawn from LRA's ListOps distribution.

  Reproducible from ``seed`` (a numpy Generator). Trees are drawn as LRA draws them, top-down:
  a node at depth ``d < max_depth`` (root depth 1) is an operator with probability 1/4 (else a
  digit), an operator takes 2..``max_args`` arguments drawn the same way, nodes at depth
  ``max_depth`` are digits (LRA: depth 10, 10 arguments, lengths 500..2000, 96k / 2k / 2k
  examples). A tree is kept when its token count is in ``[min_length, max_length]``; when
  ``min_length > 1`` the root is an operator (the same as rejecting single digits). With
  ``parens=True`` the expressions are in the LRA release form and their tokens, parentheses
  included, are counted.
  """
  return [
      (decode(ids), value)
      for ids, value in _generate_ids(
          num_examples,
          seed=seed,
          min_length=min_length,
          max_length=max_length,
          max_depth=max_depth,
          max_args=max_args,
          parens=parens,
      )
  ]


def split_seed(seed: int, split: str) -> int:
  """The generator seed of ``split`` for a task seed (different for every split)."""
  _check_int("seed", seed, 0)
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}.")
  state = np.random.SeedSequence([int(seed), SPLITS.index(split)]).generate_state(1, np.uint64)
  return int(state[0])


# ----------------------------------------------------------------------- TSV files


_TSV_FIX = (
    "The file is damaged or is not an LRA ListOps TSV: re-fetch it (`python "
    "scripts/download_data.py listops`) or fix that line."
)


def _bad_row(path: str, line_no: int, what: str) -> ValueError:
  return ValueError(f"{path}:{line_no}: {what} {_TSV_FIX}")


def _tsv_lines(path: str) -> Iterator[tuple[int, str]]:
  """(line number, text without its line end) of every line; CRLF and LF ends are read
  alike. A line that is not UTF-8 names the file, the line and the byte."""
  for line_no, raw in paths.read_lines(path):
    try:
      yield line_no, raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise _bad_row(
          path,
          line_no,
          f"not UTF-8 text (byte {raw[e.start]:#04x} at column "
          f"{e.start + 1}); the LRA files are ASCII.",
      ) from None


def _tsv_rows(path: str) -> Iterator[tuple[int, str, int, np.ndarray]]:
  """(line number, source, label, ids) of every row of an LRA ListOps TSV."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise _missing(path)
  lines = _tsv_lines(path)
  _, first = next(lines, (1, ""))
  header = first.split("\t")
  if tuple(header) != TSV_HEADER:
    raise _bad_row(
        path,
        1,
        f"header {header!r} is not the LRA ListOps header " f"{'<TAB>'.join(TSV_HEADER)!r}.",
    )
  for line_no, line in lines:
    cols = line.split("\t")
    if len(cols) != 2:
      cut = " (a cut-off row?)" if len(cols) == 1 else ""
      raise _bad_row(
          path,
          line_no,
          f"expected 2 tab-separated columns (Source, Target), " f"got {len(cols)}{cut}.",
      )
    source, target = cols
    if target.strip() not in DIGITS:
      raise _bad_row(path, line_no, f"label {target!r} is not one of 0..9.")
    try:
      ids = encode(source)
    except ValueError as e:
      raise _bad_row(path, line_no, str(e)) from None
    if ids.size == 0:
      raise _bad_row(path, line_no, "empty expression.")
    counts = np.bincount(ids, minlength=len(VOCAB))
    n_ops = int(counts[_OP_ID0 : _OP_ID0 + len(OPERATORS)].sum())
    if n_ops != counts[_CLOSE_ID] or counts[_OPEN_PAREN_ID] != counts[_CLOSE_PAREN_ID]:
      raise _bad_row(
          path,
          line_no,
          f"malformed expression: {n_ops} operators and "
          f"{counts[_CLOSE_ID]} ']', {counts[_OPEN_PAREN_ID]} '(' and "
          f"{counts[_CLOSE_PAREN_ID]} ')'.",
      )
    yield line_no, source, int(target), ids


def read_tsv(path: str) -> list[tuple[str, int]]:
  """(expression, label) rows of an LRA ListOps TSV (header ``Source<TAB>Target``).

  Every row is checked: two columns, a label 0..9, known tokens, as many ``]`` as operators and
  balanced parentheses; errors name the file and line. The expressions are returned as written
  (LRA release form, parentheses included).
  """
  return [(source, label) for _, source, label, _ in _tsv_rows(path)]


# -------------------------------------------------------------------------- splits


def _check_load_args(
    split,
    source,
    max_length,
    data_dir,
    num_examples,
    seed,
    min_length,
    cache_dir,
    on_overflow,
    parens,
) -> None:
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}.")
  if source not in SOURCES:
    raise ValueError(f"unknown source {source!r}; valid sources: {', '.join(SOURCES)}.")
  if on_overflow not in ON_OVERFLOW:
    raise ValueError(
        f"unknown on_overflow {on_overflow!r}; valid choices: " f"{', '.join(ON_OVERFLOW)}."
    )
  _check_int("max_length", max_length, 1)
  _check_int("num_examples", num_examples, 0)
  if not isinstance(parens, bool):
    raise ValueError(f"parens must be True or False, got {parens!r}.")
  if cache_dir is not None and not (
      isinstance(cache_dir, (str, os.PathLike)) and os.fspath(cache_dir)
  ):
    raise ValueError(f"cache_dir must be a non-empty path or None, got {cache_dir!r}.")
  if source == "tsv":
    if data_dir is None or not os.fspath(data_dir):
      raise ValueError(
          "source='tsv' needs data_dir, the folder of the LRA ListOps files "
          f"({', '.join(TSV_FILES.values())})."
      )
  else:
    _check_int("seed", seed, 0)
    _check_int("min_length", min_length, 1)
    if min_length > max_length:
      raise ValueError(f"min_length={min_length} exceeds max_length={max_length}.")


def _cache_path(cache_dir: str, key: dict) -> str:
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
  if key["source"] == "generated":
    desc = f"n{key['num_examples']}_len{key['min_length']}-{key['max_length']}_seed{key['seed']}"
  else:
    desc = f"n{key['num_examples']}_max{key['max_length']}"
  name = (
      f"listops_v{CACHE_VERSION}_{key['source']}_{key['split']}_{desc}_"
      f"{'parens' if key['parens'] else 'noparens'}_{key['on_overflow']}_{digest}.npz"
  )
  return os.path.join(os.fspath(cache_dir), name)


def _warn_truncated(num_truncated: int, n: int, max_length: int, split: str) -> None:
  logging.warning(
      "ListOps %s: %d of %d expressions are longer than max_length=%d and were "
      "truncated (their labels no longer follow from the input).",
      split,
      num_truncated,
      n,
      max_length,
  )


def load_split(
    split: str,
    *,
    source: str,
    max_length: int,
    data_dir: str | None = None,
    num_examples: int = 0,
    seed: int = 0,
    min_length: int = 500,
    cache_dir: str | None = None,
    on_overflow: str = "truncate",
    parens: bool = False,
) -> dict[str, np.ndarray]:
  """One split as arrays: ``inputs`` int32 ``[n, max_length]`` (0-padded ids), ``targets``
  int32 ``[n]`` (the value 0..9).

  Args:
    split: "train", "validation" or "test" (LRA files basic_train / basic_val / basic_test).
    source: "generated" (``generate`` with LRA's depth 10 / 10 arguments, lengths in
      ``[min_length, max_length]``, seed ``split_seed(seed, split)``) or "tsv" (the LRA file of
      the split in the folder ``data_dir``; ``seed`` and ``min_length`` are not used).
    data_dir: for "tsv", the folder that holds the TSVs (in the data root's layout:
      ``tsv_dir(root)`` = ``<root>/lra_release/listops-1000``; the task passes that).
    max_length: padded length; for "generated" also the longest expression.
    num_examples: examples to generate (0: LRA's 96000 / 2000 / 2000) or, for "tsv", the first
      ``num_examples`` rows of the file (0: all; more than the file holds is an error).
    cache_dir: when given, the arrays are saved there as an .npz named by every argument that
      changes them (and ``CACHE_VERSION``; tsv: the file's path, size and mtime) and loaded from
      it on the next call.
    on_overflow: for expressions longer than ``max_length``: "truncate" (keep the first
      ``max_length`` tokens; one warning gives the count) or "error" (ValueError).
    parens: keep the parentheses of the LRA release format (False: drop them, as the fixed LRA
      pipeline does).
  """
  _check_load_args(
      split,
      source,
      max_length,
      data_dir,
      num_examples,
      seed,
      min_length,
      cache_dir,
      on_overflow,
      parens,
  )
  key = {
      "version": CACHE_VERSION,
      "split": split,
      "source": source,
      "max_length": int(max_length),
      "num_examples": int(num_examples),
      "parens": parens,
      "on_overflow": on_overflow,
  }
  if source == "generated":
    key.update(seed=int(seed), min_length=int(min_length))
  else:
    path = os.path.join(os.fspath(data_dir), TSV_FILES[split])
    if not os.path.isfile(path):
      raise _missing(path)
    st = os.stat(path)
    key.update(path=os.path.abspath(path), size=st.st_size, mtime_ns=st.st_mtime_ns)

  cache_path = _cache_path(cache_dir, key) if cache_dir is not None else None
  if cache_path is not None and os.path.exists(cache_path):
    return _load_cache(cache_path, key, split)

  if source == "generated":
    n = num_examples or LRA_SIZES[split]
    rows = _generate_ids(
        n,
        seed=split_seed(seed, split),
        min_length=min_length,
        max_length=max_length,
        max_depth=10,
        max_args=10,
        parens=parens,
    )
  else:
    rows = []
    for _, _, label, ids in _tsv_rows(path):
      if not parens:
        ids = ids[(ids != _OPEN_PAREN_ID) & (ids != _CLOSE_PAREN_ID)]
      rows.append((ids, label))
      if num_examples and len(rows) == num_examples:
        break
    if num_examples > len(rows):
      raise ValueError(f"num_examples={num_examples} but {path!r} holds {len(rows)} examples.")

  inputs = np.zeros((len(rows), max_length), np.int32)
  targets = np.empty(len(rows), np.int32)
  num_truncated = 0
  for i, (ids, label) in enumerate(rows):
    if ids.size > max_length:
      if on_overflow == "error":
        raise ValueError(
            f"ListOps {split} example {i} has {ids.size} tokens, more than "
            f"max_length={max_length} (on_overflow='error'; 'truncate' keeps the "
            f"first max_length tokens)."
        )
      num_truncated += 1
    m = min(ids.size, max_length)
    inputs[i, :m] = ids[:m]
    targets[i] = label
  if num_truncated:
    _warn_truncated(num_truncated, len(rows), max_length, split)
  out = {"inputs": inputs, "targets": targets}
  if cache_path is not None:
    paths.save_npz_atomic(
        cache_path,
        {
            **out,
            "num_truncated": np.int64(num_truncated),
            "key": np.array(json.dumps(key, sort_keys=True)),
        },
    )
  return out


def _load_cache(path: str, key: dict, split: str) -> dict[str, np.ndarray]:
  with np.load(path, allow_pickle=False) as z:
    stored = {k: z[k] for k in z.files}
  want = json.dumps(key, sort_keys=True)
  if set(stored) != {"inputs", "targets", "num_truncated", "key"} or str(stored["key"]) != want:
    raise ValueError(
        f"ListOps cache file {path!r} does not hold the split asked for "
        f"({want}); delete it to rebuild."
    )
  inputs, targets = stored["inputs"], stored["targets"]
  if (
      inputs.dtype != np.int32
      or targets.dtype != np.int32
      or inputs.ndim != 2
      or inputs.shape[1] != key["max_length"]
      or targets.shape != inputs.shape[:1]
  ):
    raise ValueError(
        f"ListOps cache file {path!r} has inputs {inputs.dtype}{inputs.shape} and "
        f"targets {targets.dtype}{targets.shape}; delete it to rebuild."
    )
  if int(stored["num_truncated"]):
    _warn_truncated(int(stored["num_truncated"]), inputs.shape[0], key["max_length"], split)
  return {"inputs": inputs, "targets": targets}


# ---------------------------------------------------------------------------------------------
# The trainer task
# ---------------------------------------------------------------------------------------------
class ListOpsTask(base.Task):
  """LRA ListOps (Tay et al. 2021, Sec. 3.1; Nangia & Bowman 2018): classify the value 0..9.

  ``config.task.data_dir`` is the data root (``fastpos.tasks.paths``; "" =
  ``$FASTPOS_DATA_DIR``, else ``~/fastpos_data``). With ``source="tsv"`` the files are read from
  ``<root>/lra_release/listops-1000/basic_{train,val,test}.tsv``, which ``python
  scripts/download_data.py listops --data_dir <root>`` fetches (the LRA release archive, ~7 GB,
  shared with lra_retrieval and pathfinder). The generated source reads nothing.
  """

  task_name = "listops"
  config_fields = {
      # "generated": the project's own generator (deterministic from `seed`); "tsv": the LRA
      # release (basic_train.tsv, basic_val.tsv, basic_test.tsv) under the data root.
      "source": fields.string("generated", SOURCES),
      # Data root (fastpos.tasks.paths; "" = $FASTPOS_DATA_DIR, else ~/fastpos_data);
      # source="tsv" reads <root>/lra_release/listops-1000/basic_{train,val,test}.tsv.
      "data_dir": fields.path(),
      "cache_dir": fields.path(trajectory=False),  # generated / tokenised splits ("" = no cache)
      "max_length": fields.integer(2000, 1),  # padded length (LRA: 2000)
      "min_length": fields.integer(500, 1),  # shortest generated expression in tokens (LRA: 500)
      # Examples per split; 0 means the loader's default (LRA sizes: 96k / 2k / 2k).
      **base.split_sizes(),
      "seed": fields.seed(),  # generator seed (independent of the training seed)
      "on_overflow": fields.string("truncate", ON_OVERFLOW),  # longer ones: truncate or error
      # Keep the parentheses of the LRA release format (False: the fixed LRA task, where `]`
      # is a token and the parentheses are dropped).
      "parens": fields.boolean(False),
  }

  @classmethod
  def info_from_config(cls, cfg: ml_collections.ConfigDict) -> TaskInfo:
    return TaskInfo(
        kind="classify", vocab_size=len(VOCAB), num_classes=NUM_CLASSES, max_length=cfg.max_length
    )

  def fingerprint(self) -> dict[str, Any]:
    """The settings (the generator's, for ``source="generated"``) and, from the LRA release,
    the SHA-256 of the train and validation files' bytes (what a training run reads)."""
    out = super().fingerprint()
    if self.cfg.source == "tsv":
      folder = tsv_dir(self.cfg.data_dir or None)
      files = [os.path.join(folder, TSV_FILES[s]) for s in ("train", "validation")]
      out["files"] = [[p, base.file_digest(p)] for p in files]
    return out

  def load_split(self, split: str) -> dict[str, np.ndarray]:
    cfg = self.cfg
    n = {"train": cfg.num_train, "validation": cfg.num_validation, "test": cfg.num_test}[split]
    folder = None
    if cfg.source == "tsv":
      folder = tsv_dir(cfg.data_dir or None)
      paths.require(
          self.task_name,
          os.path.join(folder, TSV_FILES[split]),
          cfg.data_dir or None,
          "an LRA ListOps file",
      )
    data = load_split(
        split,
        source=cfg.source,
        max_length=cfg.max_length,
        data_dir=folder,
        num_examples=n,
        seed=cfg.seed,
        min_length=cfg.min_length,
        cache_dir=cfg.cache_dir or None,
        on_overflow=cfg.on_overflow,
        parens=cfg.parens,
    )
    return {"inputs": data["inputs"], "targets": data["targets"]}
