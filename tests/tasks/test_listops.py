"""ListOps: tokens, evaluator, generator, LRA TSV reader and load_split.

The labels are checked against two evaluators written here, differently from the module's
(iterative stack): Python's own parser on the expression rewritten as nested calls, with
``statistics.median`` for [MED; and a recursive parser of LRA's release format (binary pairs in
parentheses) folded the way LRA's generator computes values.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics

import numpy as np
import pytest

from fastpos.tasks import listops as lo
from fastpos.tasks.paths import SAMPLES

# The data root of the sample (fastpos/tasks/samples/listops) holds it where the task reads it.
TESTDATA_ROOT = os.path.join(SAMPLES, "listops")
TESTDATA = os.path.join(TESTDATA_ROOT, "lra_release", "listops-1000")
SHORT = dict(min_length=20, max_length=60)  # most tests: short expressions, fast
OPS = ("[MIN", "[MAX", "[MED", "[SM")


# ------------------------------------------------------------ independent evaluators

_CALLS = {"[MIN": "MIN(", "[MAX": "MAX(", "[MED": "MED(", "[SM": "SM("}
_FUNCS = {
    "MIN": lambda *a: min(a),
    "MAX": lambda *a: max(a),
    "MED": lambda *a: math.floor(statistics.median(a)),
    "SM": lambda *a: sum(a) % 10,
}


def eval_python(expr: str) -> int:
  """Value via Python's parser: `[MAX 2 [MIN 3 4 ] ]` -> `MAX(2,MIN(3,4,),)`."""
  parts = []
  for tok in expr.split():
    if tok in "()":
      continue
    parts.append(_CALLS[tok] if tok in _CALLS else ")," if tok == "]" else f"{int(tok)},")
  return eval("".join(parts).rstrip(","), {"__builtins__": {}}, dict(_FUNCS))


def parse_lra(tokens: list[str], i: int = 0):
  """Recursive parser of LRA's release form: item := '(' item item ')' | token."""
  if tokens[i] == "(":
    left, i = parse_lra(tokens, i + 1)
    right, i = parse_lra(tokens, i)
    assert tokens[i] == ")", (i, tokens[i])
    return (left, right), i + 1
  assert tokens[i] != ")", i
  return (int(tokens[i]) if tokens[i].isdigit() else tokens[i]), i + 1


def lra_value(t):
  """LRA's fold: (OP, a) starts a partial application, (partial, a) adds a, (partial, ']')
  applies it."""
  if not isinstance(t, tuple):
    return t
  left, right = lra_value(t[0]), lra_value(t[1])
  if left in OPS:
    return (left, [right])
  if right == "]":
    return _FUNCS[left[0][1:]](*left[1])
  return (left[0], left[1] + [right])


def lra_string(t) -> str:
  if not isinstance(t, tuple):
    return str(t)
  return f"( {lra_string(t[0])} {lra_string(t[1])} )"


def eval_lra(expr: str) -> int:
  tokens = expr.split()
  t, end = parse_lra(tokens)
  assert end == len(tokens)
  return lra_value(t)


def parse_tree(expr: str):
  """Paren-free form -> int | (op, [children]) (recursive)."""
  tokens = [t for t in expr.split() if t not in "()"]

  def item(i):
    if tokens[i] in OPS:
      op, args, i = tokens[i], [], i + 1
      while tokens[i] != "]":
        a, i = item(i)
        args.append(a)
      return (op, args), i + 1
    return int(tokens[i]), i + 1

  t, end = item(0)
  assert end == len(tokens)
  return t


def to_lra_tuples(t):
  """A parsed tree in LRA's generator layout: ((((OP, a1), a2), ...), ']')."""
  if isinstance(t, int):
    return t
  op, args = t
  acc = (op, to_lra_tuples(args[0]))
  for a in args[1:]:
    acc = (acc, to_lra_tuples(a))
  return (acc, "]")


def depth_and_args(t, depth=1):
  """(max depth, list of argument counts) of a parsed tree; the root has depth 1."""
  if isinstance(t, int):
    return depth, []
  deepest, counts = depth, [len(t[1])]
  for a in t[1]:
    d, c = depth_and_args(a, depth + 1)
    deepest, counts = max(deepest, d), counts + c
  return deepest, counts


# ----------------------------------------------------------------------- tokens


def test_vocab():
  assert lo.VOCAB[0] == "<pad>"
  assert len(set(lo.VOCAB)) == len(lo.VOCAB) == 18
  assert set(lo.VOCAB[1:]) == set("0123456789") | set(OPS) | {"]", "(", ")"}


def test_encode_decode_round_trip():
  expr = "( ( ( [MED 2 ) 5 ) ] ) [SM 1 [MAX 3 4 ] 9 ] [MIN 0 8 ]"
  ids = lo.encode(expr)
  assert ids.dtype == np.int32
  np.testing.assert_array_equal(ids, [lo.VOCAB.index(t) for t in expr.split()])
  assert lo.decode(ids) == expr
  assert lo.decode(np.concatenate([ids, np.zeros(7, np.int32)])) == expr  # trailing padding
  # Irregular whitespace tokenises like str.split().
  np.testing.assert_array_equal(lo.encode(" [MAX\t1  2\n]  "), lo.encode("[MAX 1 2 ]"))
  assert lo.encode("").shape == (0,)
  for expr, _ in lo.generate(20, seed=3, **SHORT) + lo.generate(20, seed=3, parens=True, **SHORT):
    assert lo.decode(lo.encode(expr)) == expr


@pytest.mark.parametrize(
    "expr,token,pos",
    [
        ("[MAX 2 [MEDIAN 3 ] ]", "[MEDIAN", 2),
        ("MAX 4 3 MIN 2 3 ", "MAX", 0),  # LRA's bracket-less tokens are not ListOps tokens here
        ("[min 1 2 ]", "[min", 0),
        ("[MAX 1 2 ]]", "]]", 3),
        ("[MIN5 ]", "[MIN5", 0),
        ("1 10", "10", 1),
        ("[MAX 1 <pad> ]", "<pad>", 2),
    ],
)
def test_encode_unknown_token(expr, token, pos):
  with pytest.raises(ValueError, match=rf"{token!r}.*position {pos}".replace("[", r"\[")):
    lo.encode(expr)


def test_decode_errors():
  with pytest.raises(ValueError, match="position 1"):
    lo.decode([1, 18])
  with pytest.raises(ValueError, match="padding id 0 at position 1"):
    lo.decode([1, 0, 2])
  with pytest.raises(ValueError, match="1-D integer"):
    lo.decode(np.ones((2, 2), np.int32))


def test_brackets_are_tokens():
  # Two expressions that differ only in where a ']' sits: different values, different ids.
  a, b = "[MAX [MIN 1 2 ] 3 ]", "[MAX [MIN 1 2 3 ] ]"
  assert lo.evaluate(a) == 3 and lo.evaluate(b) == 1
  assert lo.encode(a).size == lo.encode(b).size == 7
  assert not np.array_equal(lo.encode(a), lo.encode(b))
  close, open_p, close_p = (lo.VOCAB.index(t) for t in ("]", "(", ")"))
  assert np.sum(lo.encode("( ( [MAX 2 ) 9 ) ] )") == close) == 1
  assert np.sum(lo.encode("( ( ( [MAX 2 ) 9 ) ] )") == open_p) == 3
  assert np.sum(lo.encode("( ( ( [MAX 2 ) 9 ) ] )") == close_p) == 3
  # Every generated operator has its ']' in the ids the model sees, and lengths count them.
  data = lo.load_split("train", source="generated", num_examples=30, seed=0, **SHORT)
  n_ops = np.isin(data["inputs"], [lo.VOCAB.index(o) for o in OPS]).sum(axis=1)
  np.testing.assert_array_equal(n_ops, (data["inputs"] == close).sum(axis=1))
  assert n_ops.min() >= 1
  lengths = (data["inputs"] != 0).sum(axis=1)
  assert lengths.min() >= 20 and lengths.max() <= 60


# ---------------------------------------------------------------------- evaluator


@pytest.mark.parametrize(
    "expr,value",
    [
        ("7", 7),
        ("[MIN 4 2 8 ]", 2),
        ("[MAX 4 2 8 ]", 8),
        ("[MED 4 2 8 ]", 4),
        ("[MED 2 5 ]", 3),  # even count: LRA's int(np.median) floors 3.5
        ("[MED 9 0 5 2 ]", 3),
        ("[MED 1 2 ]", 1),
        ("[SM 9 9 9 ]", 7),
        ("[SM 5 5 ]", 0),
        ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),
        ("[SM [MED 1 8 ] [MIN [MAX 3 9 ] 6 ] 2 ]", 2),
        ("( ( ( ( ( [MAX 2 ) 9 ) ( ( ( [MIN 4 ) 7 ) ] ) ) 0 ) ] )", 9),
    ],
)
def test_evaluate_known(expr, value):
  assert lo.evaluate(expr) == value
  assert eval_python(expr) == value


def test_evaluate_median_matches_numpy():
  rng = np.random.default_rng(0)
  for n in range(1, 12):
    for _ in range(20):
      args = rng.integers(0, 10, size=n)
      expr = "[MED " + " ".join(map(str, args)) + " ]"
      assert lo.evaluate(expr) == int(np.median(args)), expr


def test_evaluate_deep_and_long():
  # Iterative: nesting far deeper than Python's recursion limit, and thousands of tokens.
  assert lo.evaluate("[MAX " * 5000 + "7 " + "] " * 5000) == 7
  assert lo.evaluate("[SM " + "1 " * 3000 + "]") == 0


@pytest.mark.parametrize(
    "expr,match",
    [
        ("", "empty"),
        ("[MAX 1 2", "not closed"),
        ("1 2", "follows the end"),
        ("[MAX 1 ] 3", "follows the end"),
        ("]", "closes no operator"),
        ("[MAX ]", "no arguments"),
        ("( [MAX 1 ]", r"'\(' not closed"),
        ("[MAX 1 ] )", r"unbalanced '\)'"),
        ("[MAX 1 x ]", "unknown ListOps token 'x'"),
    ],
)
def test_evaluate_errors(expr, match):
  with pytest.raises(ValueError, match=match):
    lo.evaluate(expr)


# ---------------------------------------------------------------------- generator


def test_generate_deterministic_and_seeded():
  a = lo.generate(25, seed=1, **SHORT)
  assert a == lo.generate(25, seed=1, **SHORT)
  assert a != lo.generate(25, seed=2, **SHORT)
  assert a[:10] == lo.generate(10, seed=1, **SHORT)  # a prefix of the same stream
  assert lo.generate(0, seed=1, **SHORT) == []


@pytest.mark.parametrize("parens", [False, True])
def test_generate_lengths_and_labels(parens):
  data = lo.generate(150, seed=4, parens=parens, **SHORT)
  assert len(data) == 150
  for expr, label in data:
    n = len(expr.split())
    assert 20 <= n <= 60
    assert label == lo.evaluate(expr) == eval_python(expr)
    if parens:
      assert n % 3 == 1  # 3 L - 2 for L paren-free tokens
      assert eval_lra(expr) == label
      # Exactly LRA's release layout of the same tree.
      assert expr == lra_string(to_lra_tuples(parse_tree(expr)))
    else:
      assert "(" not in expr and ")" not in expr


def test_generate_lra_window():
  data = lo.generate(40, seed=5)  # LRA defaults: 500..2000 tokens, depth 10, 10 arguments
  for expr, label in data:
    assert 500 <= len(expr.split()) <= 2000
    assert label == eval_python(expr)
    depth, counts = depth_and_args(parse_tree(expr))
    assert depth <= 10 and min(counts) >= 2 and max(counts) <= 10


def test_generate_tree_limits():
  data = lo.generate(200, seed=6, min_length=4, max_length=300, max_depth=4, max_args=3)
  depths, counts = [], []
  for expr, label in data:
    d, c = depth_and_args(parse_tree(expr))
    depths.append(d)
    counts += c
    assert label == eval_python(expr)
  assert max(depths) == 4 and min(depths) >= 2  # root forced to be an operator (min_length > 1)
  assert set(counts) == {2, 3}
  # The longest tree the limits allow (every node above depth 3 an operator with 3 arguments:
  # 4 operators, 9 digits) is reachable, and the bound is exact.
  full = lo.generate(2, seed=0, min_length=17, max_length=17, max_depth=3, max_args=3)
  assert [len(e.split()) for e, _ in full] == [17, 17]
  assert all(v == eval_python(e) for e, v in full)


def test_generate_tree_distribution():
  # A window holding every tree (depth 3, 3 arguments: 1..17 tokens) leaves LRA's process
  # unconditioned: a node above max_depth is an operator w.p. 1/4, 2..max_args arguments and
  # the operator uniform. 3000 trees: standard errors ~0.01.
  trees = [
      parse_tree(e)
      for e, _ in lo.generate(3000, seed=8, min_length=1, max_length=17, max_depth=3, max_args=3)
  ]
  roots = [t for t in trees if not isinstance(t, int)]
  assert abs(len(roots) / len(trees) - 0.25) < 0.04
  second = [a for t in roots for a in t[1]]
  assert abs(np.mean([not isinstance(a, int) for a in second]) - 0.25) < 0.04
  ops = [t for t in roots] + [a for a in second if not isinstance(a, int)]
  assert abs(np.mean([len(t[1]) for t in ops]) - 2.5) < 0.06
  freq = np.array([sum(t[0] == op for t in ops) for op in OPS]) / len(ops)
  assert np.all(np.abs(freq - 0.25) < 0.06), freq
  digits = np.bincount([t for t in trees if isinstance(t, int)], minlength=10) / (
      len(trees) - len(roots)
  )
  assert np.all(np.abs(digits - 0.1) < 0.035), digits


def test_generate_covers_all_classes():
  labels = np.array([v for _, v in lo.generate(400, seed=7, **SHORT)])
  counts = np.bincount(labels, minlength=10)
  assert counts.size == 10 and counts.min() > 0, counts


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(min_length=61, max_length=60), "exceeds max_length"),
        (dict(max_args=1), "max_args must be an integer >= 2"),
        (dict(max_depth=0), "max_depth must be an integer >= 1"),
        (dict(seed=-1), "seed must be an integer >= 0"),
        (dict(num_examples=-1), "num_examples must be an integer >= 0"),
        (
            dict(min_length=500, max_length=600, max_depth=3, max_args=3),
            "possible lengths are 4..17",
        ),
        (dict(parens="yes"), "parens must be True or False"),
    ],
)
def test_generate_bad_arguments(kwargs, match):
  args = dict(num_examples=3, seed=0, **SHORT)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    lo.generate(args.pop("num_examples"), **args)


def test_generate_unreachable_window(monkeypatch):
  # With parentheses every length is 3 L - 2: 11 tokens is impossible though within 10..max.
  monkeypatch.setattr(lo, "MAX_CONSECUTIVE_REJECTIONS", 2048)
  with pytest.raises(ValueError, match="in a row fell outside"):
    lo.generate(1, seed=0, min_length=11, max_length=11, parens=True)


# ------------------------------------------------------------------------ TSV files


def _fixture(split):
  return os.path.join(TESTDATA, f"basic_{split}.tsv")


@pytest.mark.parametrize("split,count", [("train", 12), ("val", 4), ("test", 4)])
def test_read_tsv_fixtures(split, count):
  with open(_fixture(split), "rb") as f:
    assert f.readline() == b"Source\tTarget\r\n"  # LRA's csv.writer rows end in CRLF
  rows = lo.read_tsv(_fixture(split))
  assert len(rows) == count
  for expr, label in rows:
    assert "(" in expr and "]" in expr
    assert label == eval_lra(expr) == eval_python(expr) == lo.evaluate(expr)
    assert expr == lra_string(to_lra_tuples(parse_tree(expr)))


def _write(tmp_path, text, name="basic_train.tsv"):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize(
    "body,match",
    [
        ("Src\tTarget\n[MAX 1 2 ]\t2\n", r":1: header"),
        ("Source\tTarget\n[MAX 1 2 ]\t2\n[MIN 1 2 ]\t1\textra\n", r":3: expected 2 .*got 3"),
        ("Source\tTarget\n[MAX 1 2 ]\n", r":2: expected 2 .*got 1"),
        ("Source\tTarget\n[MAX 1 2 ]\t10\n", r":2: label '10'"),
        ("Source\tTarget\n[MAX 1 2 ]\tx\n", r":2: label 'x'"),
        (
            "Source\tTarget\n[MAX 1 2 ]\t2\n[MEDIAN 1 2 ]\t1\n",
            r":3: unknown ListOps token '\[MEDIAN'",
        ),
        ("Source\tTarget\n[MAX 1 2\t2\n", r":2: malformed expression"),
        ("Source\tTarget\n( [MAX 1 2 ]\t2\n", r":2: malformed expression"),
        ("Source\tTarget\n\t2\n", r":2: empty expression"),
    ],
)
def test_read_tsv_bad_lines(tmp_path, body, match):
  path = _write(tmp_path, body)
  with pytest.raises(ValueError, match=rf"basic_train\.tsv{match}"):
    lo.read_tsv(path)


def test_read_tsv_missing_file(tmp_path):
  path = str(tmp_path / "nowhere" / "basic_val.tsv")
  with pytest.raises(FileNotFoundError) as e:
    lo.read_tsv(path)
  msg = str(e.value)
  assert path in msg
  assert "python scripts/download_data.py listops --data_dir" in msg
  with pytest.raises(FileNotFoundError, match="download_data.py listops"):
    lo.load_split("validation", source="tsv", data_dir=str(tmp_path), max_length=50)
  # In the data root's layout, the command names the root.
  inner = lo.tsv_dir(str(tmp_path / "root"))
  assert inner == str(tmp_path / "root" / "lra_release" / "listops-1000")
  with pytest.raises(FileNotFoundError) as e:
    lo.read_tsv(os.path.join(inner, "basic_test.tsv"))
  assert f"download_data.py listops --data_dir {tmp_path / 'root'}`" in str(e.value)


# -------------------------------------------------------------------------- load_split


def _check_arrays(data, n, max_length):
  inputs, targets = data["inputs"], data["targets"]
  assert set(data) == {"inputs", "targets"}
  assert inputs.dtype == np.int32 and targets.dtype == np.int32
  assert inputs.shape == (n, max_length) and targets.shape == (n,)
  lengths = (inputs != 0).sum(axis=1)
  for row, length in zip(inputs, lengths):  # real tokens first, then only padding
    assert np.all(row[:length] > 0) and np.all(row[length:] == 0)
  assert targets.min() >= 0 and targets.max() <= 9
  return lengths


def test_load_split_generated():
  splits = {}
  for split in lo.SPLITS:
    data = lo.load_split(
        split, source="generated", max_length=64, num_examples=30, seed=3, min_length=20
    )
    lengths = _check_arrays(data, 30, 64)
    assert lengths.min() >= 20 and lengths.max() <= 64
    expected = lo.generate(30, seed=lo.split_seed(3, split), min_length=20, max_length=64)
    for row, length, target, (expr, label) in zip(
        data["inputs"], lengths, data["targets"], expected
    ):
      np.testing.assert_array_equal(row[:length], lo.encode(expr))
      assert target == label == eval_python(lo.decode(row))
    splits[split] = data["inputs"]
  assert not np.array_equal(splits["train"], splits["validation"])
  assert not np.array_equal(splits["validation"], splits["test"])
  again = lo.load_split(
      "test", source="generated", max_length=64, num_examples=30, seed=3, min_length=20
  )
  np.testing.assert_array_equal(again["inputs"], splits["test"])
  other = lo.load_split(
      "test", source="generated", max_length=64, num_examples=30, seed=4, min_length=20
  )
  assert not np.array_equal(other["inputs"], splits["test"])


def test_load_split_generated_default_size(monkeypatch):
  monkeypatch.setattr(lo, "LRA_SIZES", {"train": 7, "validation": 3, "test": 2})
  data = lo.load_split("validation", source="generated", max_length=60, min_length=20)
  _check_arrays(data, 3, 60)


@pytest.mark.parametrize("parens", [False, True])
def test_load_split_tsv(parens):
  rows = lo.read_tsv(_fixture("val"))
  data = lo.load_split("validation", source="tsv", data_dir=TESTDATA, max_length=128, parens=parens)
  lengths = _check_arrays(data, len(rows), 128)
  for row, length, target, (expr, label) in zip(data["inputs"], lengths, data["targets"], rows):
    # Without parens: the release's redundant ( and ) tokens are dropped.
    want = expr if parens else " ".join(t for t in expr.split() if t not in ("(", ")"))
    assert lo.decode(row) == want and length == len(want.split())
    assert target == label
  first = lo.load_split("train", source="tsv", data_dir=TESTDATA, max_length=128, num_examples=5)
  _check_arrays(first, 5, 128)
  with pytest.raises(ValueError, match="num_examples=13 but .* holds 12"):
    lo.load_split("train", source="tsv", data_dir=TESTDATA, max_length=128, num_examples=13)


def test_load_split_truncate_and_error(caplog):
  lengths = [len(e.split()) for e, _ in lo.read_tsv(_fixture("train"))]
  max_length = 30
  long = [i for i, n in enumerate(lengths) if n > max_length]
  assert len(long) >= 2
  caplog.clear()
  with caplog.at_level("WARNING"):
    data = lo.load_split(
        "train", source="tsv", data_dir=TESTDATA, max_length=max_length, parens=True
    )
  warnings = [r for r in caplog.records if r.levelname == "WARNING"]
  assert len(warnings) == 1
  assert f"{len(long)} of {len(lengths)} expressions are longer than max_length=30" in (
      warnings[0].getMessage()
  )
  rows = lo.read_tsv(_fixture("train"))
  for i in long:
    np.testing.assert_array_equal(data["inputs"][i], lo.encode(rows[i][0])[:max_length])
  with pytest.raises(ValueError, match=rf"example {long[0]} has {lengths[long[0]]} tokens"):
    lo.load_split(
        "train",
        source="tsv",
        data_dir=TESTDATA,
        max_length=max_length,
        parens=True,
        on_overflow="error",
    )
  caplog.clear()
  with caplog.at_level("WARNING"):  # paren-free, everything fits: no warning
    lo.load_split("train", source="tsv", data_dir=TESTDATA, max_length=max_length)
  assert not [r for r in caplog.records if r.levelname == "WARNING"]


def _boom(*args, **kwargs):
  raise AssertionError("the cache should have been used")


def test_load_split_cache_generated(tmp_path, monkeypatch):
  cache = str(tmp_path / "cache")
  args = dict(
      source="generated", max_length=60, num_examples=20, seed=1, min_length=20, cache_dir=cache
  )
  first = lo.load_split("train", **args)
  files = os.listdir(cache)
  assert len(files) == 1 and files[0].startswith(f"listops_v{lo.CACHE_VERSION}_generated_train")
  monkeypatch.setattr(lo, "_generate_ids", _boom)
  second = lo.load_split("train", **args)
  for k in ("inputs", "targets"):
    np.testing.assert_array_equal(first[k], second[k])
    assert second[k].dtype == first[k].dtype
  monkeypatch.undo()
  # Any argument that changes the arrays names another file.
  lo.load_split("train", **{**args, "seed": 2})
  lo.load_split("test", **args)
  lo.load_split("train", **{**args, "max_length": 61})
  lo.load_split("train", **{**args, "parens": True})
  assert len(os.listdir(cache)) == 5
  assert not [f for f in os.listdir(cache) if f.startswith(".tmp")]


def test_load_split_cache_tsv(tmp_path, monkeypatch, caplog):
  data_dir = tmp_path / "lra"
  data_dir.mkdir()
  shutil.copy(_fixture("train"), data_dir / "basic_train.tsv")
  cache = str(tmp_path / "cache")
  args = dict(source="tsv", data_dir=str(data_dir), max_length=30, parens=True, cache_dir=cache)
  first = lo.load_split("train", **args)
  monkeypatch.setattr(lo, "_tsv_rows", _boom)
  caplog.clear()
  with caplog.at_level("WARNING"):
    second = lo.load_split("train", **args)
  np.testing.assert_array_equal(first["inputs"], second["inputs"])
  np.testing.assert_array_equal(first["targets"], second["targets"])
  # A truncating cache hit warns again.
  assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
  monkeypatch.undo()
  # A changed file is read again.
  (data_dir / "basic_train.tsv").write_text("Source\tTarget\n[MAX 1 2 ]\t2\n")
  third = lo.load_split("train", **args)
  assert third["inputs"].shape == (1, 30) and lo.decode(third["inputs"][0]) == "[MAX 1 2 ]"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(split="val"), "valid splits: train, validation, test"),
        (dict(source="file"), "valid sources: generated, tsv"),
        (dict(on_overflow="drop"), "valid choices: truncate, error"),
        (dict(max_length=0), "max_length must be an integer >= 1"),
        (dict(num_examples=-2), "num_examples must be an integer >= 0"),
        (dict(min_length=61), "min_length=61 exceeds max_length=60"),
        (dict(seed=-1), "seed must be an integer >= 0"),
        (dict(source="tsv"), "needs data_dir"),
        (dict(cache_dir=""), "cache_dir must be a non-empty path"),
        (dict(parens=1), "parens must be True or False"),
    ],
)
def test_load_split_bad_arguments(kwargs, match):
  args = dict(split="train", source="generated", max_length=60, num_examples=2, min_length=20)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    lo.load_split(args.pop("split"), **args)


# ------------------------------------------------------------------ the task's data root


def _task_cfg(**kw):
  from fastpos import tasks  # pylint: disable=import-outside-toplevel

  cfg = tasks.task_config("listops")
  cfg.update({"source": "tsv", "max_length": 512, **kw})
  return cfg


def test_task_reads_tsv_from_the_data_root():
  from fastpos import tasks  # pylint: disable=import-outside-toplevel

  task = tasks.make_task(_task_cfg(data_dir=TESTDATA_ROOT, parens=True))
  for split, stem in (("train", "train"), ("validation", "val"), ("test", "test")):
    rows = lo.read_tsv(_fixture(stem))
    src = task.source(split)
    assert len(src) == len(rows)
    for row, target, (expr, label) in zip(src.arrays["inputs"], src.arrays["targets"], rows):
      assert lo.decode(row) == expr and target == label


def test_task_missing_files_name_the_root(tmp_path, monkeypatch):
  from fastpos import tasks  # pylint: disable=import-outside-toplevel

  task = tasks.make_task(_task_cfg(data_dir=str(tmp_path)))
  with pytest.raises(FileNotFoundError) as e:
    task.source("validation")
  msg = str(e.value)
  assert str(tmp_path / "lra_release" / "listops-1000" / "basic_val.tsv") in msg
  assert f"python scripts/download_data.py listops --data_dir {tmp_path}`" in msg
  # "" means $FASTPOS_DATA_DIR.
  monkeypatch.setenv("FASTPOS_DATA_DIR", str(tmp_path / "env"))
  with pytest.raises(FileNotFoundError, match=r"--data_dir .*env`"):
    tasks.make_task(_task_cfg(data_dir="")).source("train")
