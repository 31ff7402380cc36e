"""train.py and eval.py on bad input: one line on stderr naming the problem, the exit code of
fastpos.train.errors, no traceback (none from background threads either), the workdir as it
was. Plus the config loader behind them (fastpos.train.cli), in process.

The program cases run as real processes, all but one of each kind forked from one driver
(tests/train/forked.py) that pays the imports once; they stop at start-up (no compile) but for
the eval.py cases, which share one workdir trained for two steps.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastpos import tasks
from fastpos.models import build_model
from fastpos.train import cli, errors, program
from tests.helpers import FAST_COMPILE_FLAGS
from tests.train import forked

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(
    p for p in (ROOT / "configs").glob("*.py") if not p.name.startswith("_") and p.stem != "common"
)
LISTOPS = "--config=configs/listops_generated.py:tiny"
LISTOPS_TSV = [
    LISTOPS,
    "--config.task.source=tsv",
    "--config.task.num_train=0",
    "--config.task.num_validation=0",
    "--config.task.num_test=0",
]
# Every command line below runs once, in the module's driver (tests/train/forked.py: one start
# for all, a forked child per command, as real programs: exit code, stderr, traceback). Those in
# FRESH run instead as fresh ``python train.py`` / ``eval.py`` processes: each kind of exit
# (config, data, workdir, eval.py) is held end to end once without the driver.
FRESH = ("config-unknown-field", "missing-data", "workdir-is-a-file", "eval-missing")


def _run(script: str, *args: str, data_dir: Path) -> subprocess.CompletedProcess:
  env = dict(os.environ, FASTPOS_DATA_DIR=str(data_dir), JAX_PLATFORMS="cpu")
  return subprocess.run(
      [sys.executable, script, *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )


def _listing(path: Path):
  """Everything under ``path`` (names, sizes, mtimes); None when it does not exist."""
  if not path.exists():
    return None
  if path.is_file():
    st = path.stat()
    return [(".", st.st_size, st.st_mtime_ns)]
  out = []
  for p in sorted(path.rglob("*")):
    st = p.stat()
    out.append((str(p.relative_to(path)), st.st_size if p.is_file() else -1, st.st_mtime_ns))
  return out


def _one_message(proc, code: int, prog: str, *needles: str) -> str:
  """Asserts exit ``code``, one line on stderr starting ``<prog>: `` and holding ``needles``,
  nothing on stdout, no traceback; returns the line."""
  out = proc.stdout + proc.stderr
  assert "Traceback" not in out, out[-4000:]
  assert proc.returncode == code, out[-4000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr[-4000:]
  assert lines[0].startswith(f"{prog}: "), lines[0]
  for needle in needles:
    assert needle in lines[0], (needle, lines[0])
  assert not proc.stdout.strip(), proc.stdout[-2000:]
  return lines[0]


def _untouched(result: forked.Result) -> None:
  """Asserts the watched path is as it was before the command (None: it still does not
  exist)."""
  assert result.after == result.before, (result.before, result.after)


# ---------------------------------------------------------------------------------------------
# The commands
# ---------------------------------------------------------------------------------------------
CONFIG_ERRORS = {
    "missing-file": (
        ["--config=configs/no_such_config.py"],
        ["'configs/no_such_config.py' not found", "configs/synthetic.py"],
    ),
    "file-typo": (
        ["--config=configs/listops_generatd.py:tiny"],
        ["did you mean configs/listops_generated.py"],
    ),
    "arg-typo": (
        ["--config=configs/listops_generated.py:tiny,kernal=sikf"],
        ["unknown config argument 'kernal'; valid: kernel, pos, tiny"],
    ),
    "unknown-field": (
        [LISTOPS, "--config.model.kernell=x"],
        [
            "--config.model.kernell=x",
            "no field 'kernell'",
            "Did you mean model.kernel",
            "Fields of config.model: ",
            "positional_options",
        ],
    ),
    "field-not-block": (
        [LISTOPS, "--config.model.kernel.name=x"],
        ["config.model.kernel is a field (str)"],
    ),
    "bad-int": ([LISTOPS, "--config.num_train_steps=ten"], ["--config.num_train_steps=ten", "int"]),
    "bad-bool": ([LISTOPS, "--config.async_checkpoints=maybe"], ["Non-boolean argument", "maybe"]),
    "option-typo": (
        [LISTOPS, "--config.model.positional_options.fastrpb.per_haed=True"],
        ["scheme 'fastrpb' has no option 'per_haed'", "Did you mean per_head"],
    ),
    "scheme-typo": (
        [LISTOPS, "--config.model.positional_options.fastrbp.per_head=True"],
        ["unknown positional scheme 'fastrbp'", "Did you mean fastrpb"],
    ),
    "flag-typo": ([LISTOPS, "--workdri=x"], ["Unknown command line flag 'workdri'"]),
    "no-workdir": ([LISTOPS], ["--workdir is required"]),
}

GOOD_ROWS = "Source\tTarget\n[MAX 1 2 ]\t2\n[MIN 3 4 ]\t3\n"
MALFORMED_TSV = {
    "bad-header": (b"Src\tTarget\n[MAX 1 2 ]\t2\n", ["basic_train.tsv:1: header"]),
    "bad-label": (b"Source\tTarget\n[MAX 1 2 ]\t12\n", ["basic_train.tsv:2: label '12'"]),
    "cut-off-row": (
        b"Source\tTarget\n[MAX 1 2 ]\t2\n[MIN 3 4",
        ["basic_train.tsv:3:", "cut-off row"],
    ),
    "not-utf8": (
        b"Source\tTarget\n[MAX 1 2 ]\t2\n[MIN 3 \xe9 ]\t3\n",
        ["basic_train.tsv:3: not UTF-8 text (byte 0xe9 at column 8)"],
    ),
}

BUG_CONFIG = (
    "from configs import common\nfrom fastpos.train import config as config_lib\n"
    "def _bug(cfg):\n  raise RuntimeError('a bug in the package')\n"
    "def get_config(arg=None):\n  config_lib.validate = _bug\n"
    "  return common.base_config('synthetic')\n"
)

TRAIN_TWO_STEPS = [
    "--config=configs/synthetic.py:tiny",
    "--config.num_train_steps=2",
    "--config.eval_every_steps=2",
    "--config.checkpoint_every_steps=1",
    "--config.log_every_steps=1",
]
# Run in the driver as a script: copies the trained workdir (argv[1]) to argv[2] and flips
# bytes all over the array data files of its newest checkpoint (checkpoints/2; not the
# B-tree's), so that the array reads of that checkpoint fail.
DAMAGE_SCRIPT = """
import pathlib, shutil, sys
shutil.copytree(sys.argv[1], sys.argv[2])
for f in (pathlib.Path(sys.argv[2]) / "checkpoints" / "2" / "state").glob("ocdbt.process_*/d/*"):
  data = bytearray(f.read_bytes())
  for i in range(40, len(data), 97):
    data[i] ^= 0x5A
  f.write_bytes(bytes(data))
"""


def _unwritable_parent(tmp_path: Path) -> Path | None:
  """A folder this process cannot create folders in. Root ignores permission bits, so as root
  it is /sys (sysfs refuses mkdir); None where neither works."""
  if os.geteuid() != 0:
    parent = tmp_path / "read_only"
    parent.mkdir()
    parent.chmod(0o500)
    return parent
  probe = Path("/sys") / f"fastpos_probe_{os.getpid()}"
  try:
    probe.mkdir()
  except OSError:
    return Path("/sys")
  probe.rmdir()
  return None


def _commands(base: Path) -> dict[str, tuple[forked.Command, dict]]:
  """{case id: (command, what its test needs)}, every case in its own folder under ``base``."""
  out = {}

  def add(name, script, args, *, watch=None, **extra):
    folder = base / name
    data_dir = folder / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    extra.update(folder=folder, data_dir=data_dir)
    env = {"FASTPOS_DATA_DIR": str(data_dir), "JAX_PLATFORMS": "cpu"}
    out[name] = (forked.Command(script, list(args), env, watch), extra)
    return folder, data_dir

  for name, (args, needles) in CONFIG_ERRORS.items():
    workdir = base / f"config-{name}" / "run"
    if "--workdir is required" not in needles:
      args = [*args, f"--workdir={workdir}"]
    add(f"config-{name}", "train.py", args, watch=workdir, needles=needles)
  # The config loads and the model builds; the run then stops at the workdir (a file), which
  # is checked after the config: a cheap proof that the override was accepted.
  workdir = base / "nested-option" / "a_file"
  add(
      "nested-option",
      "train.py",
      [
          LISTOPS,
          "--config.model.positional=fastrpb",
          "--config.model.positional_options.fastrpb.per_head=True",
          f"--workdir={workdir}",
      ],
      workdir=workdir,
  )
  workdir.write_text("x")
  config = base / "bug" / "broken.py"
  add("bug", "train.py", [f"--config={config}", f"--workdir={base / 'bug' / 'run'}"])
  config.write_text(BUG_CONFIG)
  # Data errors.
  workdir = base / "missing-data" / "run"
  add(
      "missing-data",
      "train.py",
      ["--config=configs/lra_text_fastrpb.py:tiny", f"--workdir={workdir}"],
      watch=workdir,
  )
  for name, (train_tsv, needles) in MALFORMED_TSV.items():
    workdir = base / f"tsv-{name}" / "run"
    _, data_dir = add(
        f"tsv-{name}", "train.py", [*LISTOPS_TSV, f"--workdir={workdir}"], watch=workdir
    )
    folder = data_dir / "lra_release" / "listops-1000"
    folder.mkdir(parents=True)
    (folder / "basic_train.tsv").write_bytes(train_tsv)
    for split in ("basic_val.tsv", "basic_test.tsv"):
      (folder / split).write_text(GOOD_ROWS)
    out[f"tsv-{name}"][1].update(tsv_folder=folder, needles=needles)
  # Workdir errors.
  (base / "workdir-is-a-file").mkdir()
  workdir = base / "workdir-is-a-file" / "file"
  workdir.write_text("keep me")
  add("workdir-is-a-file", "train.py", [LISTOPS, f"--workdir={workdir}"], watch=workdir)
  (base / "workdir-under-a-file").mkdir()
  blocker = base / "workdir-under-a-file" / "file"
  blocker.write_text("keep me")
  add(
      "workdir-under-a-file",
      "train.py",
      [LISTOPS, f"--workdir={blocker / 'run'}"],
      watch=blocker,
      blocker=blocker,
  )
  (base / "workdir-not-writable").mkdir()
  parent = _unwritable_parent(base / "workdir-not-writable")
  if parent is not None:
    workdir = parent / f"fastpos_run_{os.getpid()}"
    add(
        "workdir-not-writable",
        "train.py",
        [LISTOPS, f"--workdir={workdir}"],
        watch=workdir,
        parent=parent,
        workdir=workdir,
    )
  # eval.py: a workdir trained for two steps (one evaluation, one checkpoint), scored, then
  # the errors (each leaves the trained workdir as it was).
  trained = base / "trained" / "run"
  add("trained", "train.py", [*TRAIN_TWO_STEPS, f"--workdir={trained}"], workdir=trained)
  data = out["trained"][1]["data_dir"]
  add("eval-alone", "eval.py", [f"--workdir={trained}"], workdir=trained)
  add(
      "eval-override",
      "eval.py",
      [
          f"--config={trained / 'config.json'}",
          f"--workdir={trained}",
          "--split=validation",
          "--config.task.num_validation=32",
      ],
      workdir=trained,
  )
  for name, args, needles in (
      ("missing", [f"--workdir={base / 'eval-missing' / 'nope'}"], ["does not exist"]),
      ("no-config", [f"--workdir={base / 'eval-no-config'}"], ["has no config.json"]),
      (
          "bad-override",
          [f"--workdir={trained}", "--config.task.num_tset=3"],
          ["no field 'num_tset'", "Did you mean task.num_test"],
      ),
  ):
    add(f"eval-{name}", "eval.py", args, watch=trained, needles=needles)
  # A copy of the trained workdir, its newest checkpoint damaged, resumed (after the eval
  # cases, which read the trained workdir as it was).
  damaged = base / "resume-damaged" / "run"
  script = base / "damage" / "damage.py"
  add("damage", str(script), [trained, damaged])
  script.write_text(DAMAGE_SCRIPT)
  add("resume-damaged", "train.py", [*TRAIN_TWO_STEPS, f"--workdir={damaged}"], workdir=damaged)
  for name in [n for n in out if n.startswith("eval-") or n == "resume-damaged"]:
    out[name][0].env["FASTPOS_DATA_DIR"] = str(data)  # the trained run's data dir
  return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """{case id: (result, what its test needs)}: the driver's results, and for the cases in
  FRESH a function that runs the command as a fresh process."""
  base = tmp_path_factory.mktemp("exits")
  commands = _commands(base)
  driven = [name for name in commands if name not in FRESH]
  try:
    # The two-step run and eval.py compile: with the fast flags (the results are not checked
    # against anything that compiles otherwise).
    results = forked.run_all(
        [commands[n][0] for n in driven], base / "outputs", {"XLA_FLAGS": FAST_COMPILE_FLAGS}
    )
  finally:
    if "workdir-not-writable" in commands:
      parent = commands["workdir-not-writable"][1]["parent"]
      if parent.is_relative_to(base):
        parent.chmod(0o700)
  out = dict(zip(driven, ((r, commands[n][1]) for n, r in zip(driven, results))))
  for name in FRESH:
    out[name] = (functools.partial(_fresh, commands[name][0]), commands[name][1])
  return out


def _fresh(command: forked.Command) -> forked.Result:
  before = None if command.watch is None else _listing(command.watch)
  proc = subprocess.run(
      [sys.executable, command.script, *command.args],
      cwd=ROOT,
      env={**os.environ, **command.env},
      capture_output=True,
      text=True,
      timeout=600,
  )
  after = None if command.watch is None else _listing(command.watch)
  return forked.Result(proc.returncode, proc.stdout, proc.stderr, before, after)


def _result(runs, name: str) -> tuple[forked.Result, dict]:
  result, extra = runs[name]
  return (result() if name in FRESH else result), extra


# ---------------------------------------------------------------------------------------------
# Config errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIG_ERRORS))
def test_train_config_errors(runs, name):
  result, extra = _result(runs, f"config-{name}")
  _one_message(result, errors.EXIT_BAD_INPUT, "train.py", *extra["needles"])
  assert result.after is None  # no workdir made


def test_nested_option_override_gets_past_the_config(runs):
  result, extra = _result(runs, "nested-option")
  _one_message(result, errors.EXIT_BAD_INPUT, "train.py", "is a file")
  assert extra["workdir"].read_text() == "x"


def test_a_bug_still_shows_its_traceback(runs):
  # A bug in the package (its config check, patched to fail by the config file): a config
  # file's own failure is the user's (one line, exit 2: test_bad_inputs.py).
  result, _ = _result(runs, "bug")
  assert result.returncode == errors.EXIT_FAILED, result.stderr
  assert "Traceback" in result.stderr and "RuntimeError: a bug in the package" in result.stderr


# ---------------------------------------------------------------------------------------------
# Data errors
# ---------------------------------------------------------------------------------------------
def test_missing_data(runs):
  result, extra = _result(runs, "missing-data")
  _one_message(
      result,
      errors.EXIT_BAD_INPUT,
      "train.py",
      "not found",
      f"python scripts/download_data.py lra_text --data_dir {extra['data_dir']}",
  )
  assert result.before is None
  _untouched(result)


@pytest.mark.parametrize("name", list(MALFORMED_TSV))
def test_malformed_listops_tsv(runs, name):
  result, extra = _result(runs, f"tsv-{name}")
  line = _one_message(
      result, errors.EXIT_BAD_INPUT, "train.py", str(extra["tsv_folder"]), *extra["needles"]
  )
  assert "download_data.py listops" in line  # the fix
  assert result.before is None
  _untouched(result)


# ---------------------------------------------------------------------------------------------
# Workdir errors
# ---------------------------------------------------------------------------------------------
def test_workdir_is_a_file(runs):
  result, extra = _result(runs, "workdir-is-a-file")
  workdir = extra["folder"] / "file"
  _one_message(result, errors.EXIT_BAD_INPUT, "train.py", f"--workdir={workdir} is a file")
  assert result.before is not None
  _untouched(result)
  assert workdir.read_text() == "keep me"


def test_workdir_under_a_file(runs):
  result, extra = _result(runs, "workdir-under-a-file")
  blocker = extra["blocker"]
  _one_message(result, errors.EXIT_BAD_INPUT, "train.py", f"under {blocker}, which is a file")
  _untouched(result)
  assert blocker.read_text() == "keep me"


def test_workdir_not_writable(runs):
  if "workdir-not-writable" not in runs:
    pytest.skip("running as root and /sys accepts folders: no unwritable folder to test with")
  result, extra = _result(runs, "workdir-not-writable")
  workdir = extra["workdir"]
  _one_message(result, errors.EXIT_BAD_INPUT, "train.py", str(workdir))
  assert result.after is None and not workdir.exists()


@pytest.fixture
def data_dir(tmp_path):
  d = tmp_path / "data"
  d.mkdir()
  return d


@pytest.mark.slow
def test_disk_full(tmp_path, data_dir):
  # A 600 kB disk: the first checkpoint (about 2 MB with this model) does not fit. Orbax
  # fails in a dozen threads at once; the run still ends in one line that says so.
  disk = tmp_path / "small_disk"
  disk.mkdir()
  if (
      os.geteuid() != 0
      or subprocess.run(
          ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)], capture_output=True
      ).returncode
      != 0
  ):
    pytest.skip("making a small disk needs root and mount (tmpfs)")
  try:
    proc = _run(
        "train.py",
        "--config=configs/synthetic.py:tiny",
        f"--workdir={disk / 'run'}",
        "--config.model.embed_dim=128",
        "--config.model.mlp_dim=512",
        data_dir=data_dir,
    )
  finally:
    subprocess.run(["umount", str(disk)], check=True)
  out = proc.stdout + proc.stderr
  assert proc.returncode == errors.EXIT_BAD_INPUT and "Traceback" not in out, out[-4000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("train.py: ") and "No space left on device" in last
  assert last.count("free space") == 1 and "another --workdir" in last, last  # the fix, once
  assert len(proc.stderr.splitlines()) < 40  # a few log lines, not hundreds


# ---------------------------------------------------------------------------------------------
# eval.py
# ---------------------------------------------------------------------------------------------
def test_the_trained_run_ends_with_its_summary_line(runs):
  result, _ = _result(runs, "trained")
  assert result.returncode == 0, result.stderr[-4000:]
  # The trainer's last line: the metric beside the baseline, tokens/s and the outputs.
  last = result.stderr.strip().splitlines()[-1]
  assert "synthetic: step 2; validation accuracy " in last, last
  assert "majority-class baseline " in last and " tokens/s; workdir " in last


def test_a_resume_past_a_damaged_checkpoint_says_so_in_one_line(runs):
  """Every read of checkpoints/2 fails: the run reports it in one warning line (without
  tensorstore's spec dump), resumes from checkpoints/1 and finishes. The
  sibling reads orbax abandons are not reported one by one, and nothing but log lines reaches
  stderr."""
  assert runs["damage"][0].returncode == 0, runs["damage"][0].stderr[-4000:]
  result, extra = _result(runs, "resume-damaged")
  assert result.returncode == 0, result.stderr[-4000:]
  lines = result.stderr.strip().splitlines()
  report = [line for line in lines if "checkpoints/2 does not load (" in line]
  assert len(report) == 1, result.stderr[-4000:]
  assert "TensorStore details" not in report[0], report[0]
  assert (extra["workdir"] / "checkpoints" / "2.corrupt").is_dir()
  assert [line for line in lines if not re.match(r"[IWEF]\d{4} ", line)] == []
  assert [line for line in lines if line.startswith(("E", "F"))] == []
  assert "synthetic: step 2; validation accuracy " in lines[-1], lines[-1]


def _results(runs, name: str, split: str) -> dict:
  (trained, _), (result, extra) = runs["trained"], _result(runs, name)
  assert trained.returncode == 0, trained.stderr[-4000:]
  out = result.stdout + result.stderr
  assert result.returncode == 0 and "Traceback" not in out, out[-4000:]
  results = json.loads((extra["workdir"] / f"results_{split}.json").read_text())
  assert json.loads(result.stdout) == results
  return results


def test_eval_workdir_alone(runs):
  results = _results(runs, "eval-alone", "test")
  assert results["step"] == 2 and results["checkpoint"] == "best"
  assert results["num_examples"] == 50  # synthetic.py:tiny's test split


def test_eval_saved_config_json_with_an_override(runs):
  results = _results(runs, "eval-override", "validation")
  assert results["step"] == 2 and results["num_examples"] == 32


@pytest.mark.parametrize("case", ["missing", "no-config", "bad-override"])
def test_eval_errors(runs, case):
  assert runs["trained"][0].returncode == 0
  result, extra = _result(runs, f"eval-{case}")
  _one_message(result, errors.EXIT_BAD_INPUT, "eval.py", *extra["needles"])
  assert result.before is not None  # the trained workdir, as it was
  _untouched(result)
  assert not (extra["folder"] / "nope").exists()


# ---------------------------------------------------------------------------------------------
# The loader, in process
# ---------------------------------------------------------------------------------------------
def _typed(value):
  """A config's values with their types, to compare configs exactly (1 != 1.0 here)."""
  if isinstance(value, dict):
    return {k: _typed(v) for k, v in value.items()}
  if isinstance(value, (tuple, list)):
    return (type(value).__name__, [_typed(v) for v in value])
  return (type(value).__name__, value)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_saved_config_json_round_trips(tmp_path, path):
  for spec in (str(path), f"{path}:tiny"):
    cfg = cli.load_config(spec)
    saved = tmp_path / "config.json"
    saved.write_text(cfg.to_json_best_effort(indent=2))  # as the trainer writes it
    back = cli.load_config(str(saved))
    assert back == cfg
    assert _typed(back.to_dict()) == _typed(cfg.to_dict())
    assert back.is_locked


def test_nested_option_overrides():
  spec = str(ROOT / "configs/synthetic.py:tiny")
  cfg = cli.load_config(
      spec,
      [
          ("model.positional", "absolute+fastrpb+lrpe+permuteformer"),
          ("model.positional_options.fastrpb.per_head", "True"),
          ("model.positional_options.fastrpb.mode_2d", "full"),
          ("model.positional_options.lrpe.type", "1"),
          ("model.positional_options.lrpe.learnable_theta", "false"),
          ("model.positional_options.permuteformer.decay", "(1.0, 1)"),
          ("model.positional_options.absolute", "{'kind': 'sinusoidal'}"),
      ],
  )
  opts = cfg.model.positional_options.to_dict()
  assert opts == {
      "fastrpb": {"per_head": True, "mode_2d": "full"},
      "lrpe": {"type": 1, "learnable_theta": False},
      "permuteformer": {"decay": (1.0, 1)},
      "absolute": {"kind": "sinusoidal"},
  }
  assert type(opts["lrpe"]["type"]) is int
  # The same config as a config file's dict literal would give: one form, one config.json.
  literal = cli.load_config(
      spec, [("model.positional_options", "{'fastrpb': {'per_head': True, 'mode_2d': 'full'}}")]
  )
  assert cfg.model.positional_options.fastrpb == literal.model.positional_options.fastrpb
  with pytest.raises(ValueError, match="fastrpb: option mode_2d='full' would be ignored"):
    build_model(cfg.model, tasks.task_info(cfg.task))  # a 2D option on a 1D task is refused
  with cfg.unlocked():
    del cfg.model.positional_options.fastrpb["mode_2d"]
  build_model(cfg.model, tasks.task_info(cfg.task))  # the options reach the schemes
  # The bare boolean forms.
  neg = cli.load_config(spec, [("model.positional_options.fastrpb.per_head", None, True)])
  assert neg.model.positional_options.fastrpb.per_head is False


@pytest.mark.parametrize(
    "key, raw, match",
    [
        ("model.positional_options.fastrpb.per_head", "sure", "Non-boolean argument"),
        ("model.positional_options.lrpe.type", "2.5", "invalid literal for int.*'2.5'"),
        ("model.positional_options.rope.base", "big", "could not convert string to float: 'big'"),
        ("model.positional_options.fastrpb.per_head.x", "1", "per_head is a field \\(bool\\)"),
        ("model.positional_options.fastrpb", "{'per_haed': True}", "has no option 'per_haed'"),
        ("model.positional_options.spe.kind", None, "spe.kind"),
        ("model.embed_dim", None, "model.embed_dim"),
        ("model.kernel_options.num_features", "1.5", "invalid literal for int.*'1.5'"),
        ("mesh.rules", "3", "mesh.rules must be a tuple of \\(regex, spec\\) pairs"),
        ("nope", "1", "the config has no field 'nope'"),
    ],
)
def test_bad_overrides(key, raw, match):
  with pytest.raises(errors.RunError, match=match) as e:
    cli.load_config(str(ROOT / "configs/synthetic.py"), [(key, raw)])
  assert e.value.exit_code == errors.EXIT_BAD_INPUT
  assert "\n" not in str(e.value)


def test_overrides_keep_types():
  cfg = cli.load_config(
      str(ROOT / "configs/synthetic.py"),
      {
          "optimizer.learning_rate": "1",
          "seed": "7",
          "async_checkpoints": "false",
          "mesh.rules": "(('mlp/.*kernel', (None, 'model')),)",
      },
  )
  assert cfg.optimizer.learning_rate == 1.0 and type(cfg.optimizer.learning_rate) is float
  assert cfg.seed == 7 and cfg.async_checkpoints is False
  assert cfg.mesh.rules == (("mlp/.*kernel", (None, "model")),)
  with pytest.raises(AttributeError):  # locked: no new fields afterwards
    cfg.new_field = 1


def test_overrides_in_argv():
  argv = [
      "train.py",
      "--config=x.py:tiny",
      "--config.a.b=1",
      "--noconfig.flag",
      "--",
      "--config.c=3",
  ]
  assert cli.overrides_in(argv) == [("--config.a.b=1", "a.b"), ("--noconfig.flag", "flag")]


def test_user_exit_codes_and_messages():
  assert program.user_exit_code(errors.NonFiniteLossError("x")) == errors.EXIT_NONFINITE
  assert program.user_exit_code(errors.WorkdirLockedError("x")) == errors.EXIT_LOCKED
  assert program.user_exit_code(ValueError("x")) == errors.EXIT_BAD_INPUT
  assert program.user_exit_code(OSError(28, "No space left on device")) == errors.EXIT_BAD_INPUT
  assert program.user_exit_code(RuntimeError("x")) is None  # a bug
  assert program.user_exit_code(KeyError("x")) is None
  full = OSError(28, "No space left on device", "/w/checkpoints/5")
  assert program.message(full) == (
      "No space left on device: '/w/checkpoints/5'; the disk is "
      "full: free space there or use a --workdir on another disk."
  )
  assert program.message(ValueError("line one\n  line two")) == "line one line two"
