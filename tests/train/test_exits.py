"""train.py and eval.py on bad input: one line on stderr naming the problem, the exit code of
fastpos.train.errors, no traceback (none from background threads either), the workdir as it
was. Plus the config loader behind them (fastpos.train.cli), in process.

The subprocess cases stop at start-up (no compile); the eval.py cases share one workdir
trained for two steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastpos import tasks
from fastpos.models import build_model
from fastpos.train import cli, errors, program

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
# What the trainer leaves today when the data check fails: the checkpoint managers are made
# before the data is read.


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


def _untouched(before, workdir: Path) -> None:
  """Asserts the workdir is as it was (None: it still does not exist)."""
  after = _listing(workdir)
  assert after == before, (before, after)


@pytest.fixture
def data_dir(tmp_path):
  d = tmp_path / "data"
  d.mkdir()
  return d


# ---------------------------------------------------------------------------------------------
# Config errors (subprocess)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, needles",
    [
        (
            ["--config=configs/no_such_config.py"],
            ["'configs/no_such_config.py' not found", "configs/synthetic.py"],
        ),
        (
            ["--config=configs/listops_generatd.py:tiny"],
            ["did you mean configs/listops_generated.py"],
        ),
        (
            ["--config=configs/listops_generated.py:tiny,kernal=sikf"],
            ["unknown config argument 'kernal'; valid: kernel, pos, tiny"],
        ),
        (
            [LISTOPS, "--config.model.kernell=x"],
            [
                "--config.model.kernell=x",
                "no field 'kernell'",
                "Did you mean model.kernel",
                "Fields of config.model: ",
                "positional_options",
            ],
        ),
        ([LISTOPS, "--config.model.kernel.name=x"], ["config.model.kernel is a field (str)"]),
        ([LISTOPS, "--config.num_train_steps=ten"], ["--config.num_train_steps=ten", "int"]),
        ([LISTOPS, "--config.async_checkpoints=maybe"], ["Non-boolean argument", "maybe"]),
        (
            [LISTOPS, "--config.model.positional_options.fastrpb.per_haed=True"],
            ["scheme 'fastrpb' has no option 'per_haed'", "Did you mean per_head"],
        ),
        (
            [LISTOPS, "--config.model.positional_options.fastrbp.per_head=True"],
            ["unknown positional scheme 'fastrbp'", "Did you mean fastrpb"],
        ),
        ([LISTOPS, "--workdri=x"], ["Unknown command line flag 'workdri'"]),
        ([LISTOPS], ["--workdir is required"]),
    ],
    ids=[
        "missing-file",
        "file-typo",
        "arg-typo",
        "unknown-field",
        "field-not-block",
        "bad-int",
        "bad-bool",
        "option-typo",
        "scheme-typo",
        "flag-typo",
        "no-workdir",
    ],
)
def test_train_config_errors(tmp_path, data_dir, args, needles):
  workdir = tmp_path / "run"
  if "--workdir is required" not in needles:
    args = [*args, f"--workdir={workdir}"]
  proc = _run("train.py", *args, data_dir=data_dir)
  _one_message(proc, errors.EXIT_BAD_INPUT, "train.py", *needles)
  assert not workdir.exists()


def test_nested_option_override_gets_past_the_config(tmp_path, data_dir):
  # The config loads and the model builds; the run then stops at the workdir (a file), which
  # is checked after the config: a cheap proof that the override was accepted.
  workdir = tmp_path / "a_file"
  workdir.write_text("x")
  proc = _run(
      "train.py",
      LISTOPS,
      "--config.model.positional=fastrpb",
      "--config.model.positional_options.fastrpb.per_head=True",
      f"--workdir={workdir}",
      data_dir=data_dir,
  )
  _one_message(proc, errors.EXIT_BAD_INPUT, "train.py", "is a file")
  assert workdir.read_text() == "x"


def test_a_bug_still_shows_its_traceback(tmp_path, data_dir):
  # A bug in the package (its config check, patched to fail by the config file): a config
  # file's own failure is the user's (one line, exit 2: test_bad_inputs.py).
  config = tmp_path / "broken.py"
  config.write_text(
      "from configs import common\nfrom fastpos.train import config as config_lib\n"
      "def _bug(cfg):\n  raise RuntimeError('a bug in the package')\n"
      "def get_config(arg=None):\n  config_lib.validate = _bug\n"
      "  return common.base_config('synthetic')\n"
  )
  proc = _run("train.py", f"--config={config}", f"--workdir={tmp_path / 'run'}", data_dir=data_dir)
  assert proc.returncode == errors.EXIT_FAILED, proc.stderr
  assert "Traceback" in proc.stderr and "RuntimeError: a bug in the package" in proc.stderr


# ---------------------------------------------------------------------------------------------
# Data errors (subprocess)
# ---------------------------------------------------------------------------------------------
def test_missing_data(tmp_path, data_dir):
  workdir = tmp_path / "run"
  proc = _run(
      "train.py",
      "--config=configs/lra_text_fastrpb.py:tiny",
      f"--workdir={workdir}",
      data_dir=data_dir,
  )
  _one_message(
      proc,
      errors.EXIT_BAD_INPUT,
      "train.py",
      "not found",
      f"python scripts/download_data.py lra_text --data_dir {data_dir}",
  )
  _untouched(None, workdir)


GOOD_ROWS = "Source\tTarget\n[MAX 1 2 ]\t2\n[MIN 3 4 ]\t3\n"


@pytest.mark.parametrize(
    "train_tsv, needles",
    [
        (b"Src\tTarget\n[MAX 1 2 ]\t2\n", ["basic_train.tsv:1: header"]),
        (b"Source\tTarget\n[MAX 1 2 ]\t12\n", ["basic_train.tsv:2: label '12'"]),
        (b"Source\tTarget\n[MAX 1 2 ]\t2\n[MIN 3 4", ["basic_train.tsv:3:", "cut-off row"]),
        (
            b"Source\tTarget\n[MAX 1 2 ]\t2\n[MIN 3 \xe9 ]\t3\n",
            ["basic_train.tsv:3: not UTF-8 text (byte 0xe9 at column 8)"],
        ),
    ],
    ids=["bad-header", "bad-label", "cut-off-row", "not-utf8"],
)
def test_malformed_listops_tsv(tmp_path, data_dir, train_tsv, needles):
  folder = data_dir / "lra_release" / "listops-1000"
  folder.mkdir(parents=True)
  (folder / "basic_train.tsv").write_bytes(train_tsv)
  for name in ("basic_val.tsv", "basic_test.tsv"):
    (folder / name).write_text(GOOD_ROWS)
  workdir = tmp_path / "run"
  proc = _run("train.py", *LISTOPS_TSV, f"--workdir={workdir}", data_dir=data_dir)
  line = _one_message(proc, errors.EXIT_BAD_INPUT, "train.py", str(folder), *needles)
  assert "download_data.py listops" in line  # the fix
  _untouched(None, workdir)


# ---------------------------------------------------------------------------------------------
# Workdir errors (subprocess)
# ---------------------------------------------------------------------------------------------
def test_workdir_is_a_file(tmp_path, data_dir):
  workdir = tmp_path / "file"
  workdir.write_text("keep me")
  before = _listing(workdir)
  proc = _run("train.py", LISTOPS, f"--workdir={workdir}", data_dir=data_dir)
  _one_message(proc, errors.EXIT_BAD_INPUT, "train.py", f"--workdir={workdir} is a file")
  assert _listing(workdir) == before and workdir.read_text() == "keep me"


def test_workdir_under_a_file(tmp_path, data_dir):
  blocker = tmp_path / "file"
  blocker.write_text("keep me")
  workdir = blocker / "run"
  proc = _run("train.py", LISTOPS, f"--workdir={workdir}", data_dir=data_dir)
  _one_message(proc, errors.EXIT_BAD_INPUT, "train.py", f"under {blocker}, which is a file")
  assert blocker.read_text() == "keep me"


def _unwritable_parent(tmp_path: Path) -> Path:
  """A folder this process cannot create folders in. Root ignores permission bits, so as root
  it is /sys (sysfs refuses mkdir); skipped where neither works."""
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
  pytest.skip("running as root and /sys accepts folders: no unwritable folder to test with")


def test_workdir_not_writable(tmp_path, data_dir):
  parent = _unwritable_parent(tmp_path)
  workdir = parent / f"fastpos_run_{os.getpid()}"
  try:
    proc = _run("train.py", LISTOPS, f"--workdir={workdir}", data_dir=data_dir)
    _one_message(proc, errors.EXIT_BAD_INPUT, "train.py", str(workdir))
    assert not workdir.exists()
  finally:
    if parent.is_relative_to(tmp_path):
      parent.chmod(0o700)


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
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A workdir trained for two steps (one evaluation, one checkpoint), and its data dir."""
  base = tmp_path_factory.mktemp("trained")
  workdir, data_dir = base / "run", base / "data"
  data_dir.mkdir()
  proc = _run(
      "train.py",
      "--config=configs/synthetic.py:tiny",
      f"--workdir={workdir}",
      "--config.num_train_steps=2",
      "--config.eval_every_steps=2",
      "--config.checkpoint_every_steps=2",
      "--config.log_every_steps=1",
      data_dir=data_dir,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  # The trainer's last line: the metric beside the baseline, tokens/s and the outputs.
  last = proc.stderr.strip().splitlines()[-1]
  assert "synthetic: step 2; validation accuracy " in last, last
  assert "majority-class baseline " in last and " tokens/s; workdir " in last
  return workdir, data_dir


def _results(proc, workdir: Path, split: str) -> dict:
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0 and "Traceback" not in out, out[-4000:]
  results = json.loads((workdir / f"results_{split}.json").read_text())
  assert json.loads(proc.stdout) == results
  return results


def test_eval_workdir_alone(trained):
  workdir, data_dir = trained
  proc = _run("eval.py", f"--workdir={workdir}", data_dir=data_dir)
  results = _results(proc, workdir, "test")
  assert results["step"] == 2 and results["checkpoint"] == "best"
  assert results["num_examples"] == 50  # synthetic.py:tiny's test split


def test_eval_saved_config_json_with_an_override(trained):
  workdir, data_dir = trained
  proc = _run(
      "eval.py",
      f"--config={workdir / 'config.json'}",
      f"--workdir={workdir}",
      "--split=validation",
      "--config.task.num_validation=32",
      data_dir=data_dir,
  )
  results = _results(proc, workdir, "validation")
  assert results["step"] == 2 and results["num_examples"] == 32


@pytest.mark.parametrize("case", ["missing", "no-config", "bad-override"])
def test_eval_errors(tmp_path, trained, case):
  workdir, data_dir = trained
  args, needles = {
      "missing": ([f"--workdir={tmp_path / 'nope'}"], ["does not exist"]),
      "no-config": ([f"--workdir={tmp_path}"], ["has no config.json"]),
      "bad-override": (
          [f"--workdir={workdir}", "--config.task.num_tset=3"],
          ["no field 'num_tset'", "Did you mean task.num_test"],
      ),
  }[case]
  before = _listing(workdir)
  proc = _run("eval.py", *args, data_dir=data_dir)
  _one_message(proc, errors.EXIT_BAD_INPUT, "eval.py", *needles)
  assert _listing(workdir) == before
  assert not (tmp_path / "nope").exists()


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
