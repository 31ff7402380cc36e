"""scripts/plot_curves.py on tiny synthetic workdirs: the points are metrics.jsonl's (the last
record of a step), the legend names what sets the runs apart, bad input is one line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plot_curves():
  spec = importlib.util.spec_from_file_location("plot_curves", ROOT / "scripts" / "plot_curves.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _workdir(root: Path, name: str, kernel: str, losses: list[float], seed: int = 0) -> Path:
  w = root / name
  w.mkdir()
  rows = [{"step": s, "split": "train", "time": 0.0, "loss": v} for s, v in enumerate(losses, 1)]
  rows.append({"step": 2, "split": "train", "time": 1.0, "loss": 9.0})  # a resume rewrote it
  rows += [{"step": 2, "split": "validation", "time": 0.0, "loss": losses[1], "accuracy": 0.5}]
  (w / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  config = {
      "seed": seed,
      "log_every_steps": int(10 * losses[0]),
      "model": {"kernel": kernel, "positional": "none"},
  }
  (w / "config.json").write_text(json.dumps(config))
  return w


def test_overlays_runs_with_labels_from_their_differences(plot_curves, tmp_path, capsys):
  a = _workdir(tmp_path, "a", "softmax", [3.0, 2.0, 1.0])
  b = _workdir(tmp_path, "b", "elu1", [4.0, 3.0, 2.5])
  assert plot_curves.labels([a, b]) == ["kernel=softmax", "kernel=elu1"]  # cadence ignored
  runs = [plot_curves.read_metrics(w) for w in (a, b)]
  assert runs[0]["train/loss"] == {1: 3.0, 2: 9.0, 3: 1.0}
  metrics = plot_curves.default_metrics(runs)
  assert metrics == ["train/loss", "validation/accuracy", "validation/loss"]
  fig = plot_curves.plot(runs, plot_curves.labels([a, b]), metrics)
  ax = fig.axes[0]
  assert ax.get_title() == "training loss" and ax.get_xlabel() == "training step"
  assert [t.get_text() for t in ax.get_legend().get_texts()] == ["kernel=softmax", "kernel=elu1"]
  lines = ax.get_lines()
  assert list(lines[1].get_ydata()) == [4.0, 9.0, 2.5]
  assert lines[0].get_color() != lines[1].get_color()
  out = tmp_path / "figs" / "curves.pdf"
  assert plot_curves.main([str(a), str(b), "--out", str(out), "--labels", "Softmax,ELU+1"]) == 0
  assert out.read_bytes().startswith(b"%PDF")
  assert capsys.readouterr().out.strip() == f"plot_curves: {out}"


def test_seeds_of_a_variant_draw_their_mean_and_a_min_max_band(plot_curves, tmp_path):
  a0 = _workdir(tmp_path, "a0", "softmax", [3.0, 2.0, 1.0], seed=0)
  a1 = _workdir(tmp_path, "a1", "softmax", [5.0, 4.0, 2.0], seed=1)
  b0 = _workdir(tmp_path, "b0", "elu1", [4.0, 3.0, 2.5], seed=0)
  names = plot_curves.labels([a0, a1, b0])
  assert names == ["kernel=softmax", "kernel=softmax", "kernel=elu1"]  # the seed sets none apart
  runs = [plot_curves.read_metrics(w) for w in (a0, a1, b0)]
  runs[1]["validation/num_examples"] = runs[0]["validation/num_examples"] = {2: 10.0}
  assert "validation/num_examples" not in plot_curves.default_metrics(runs)
  ax = plot_curves.plot(runs, names, ["train/loss"]).axes[0]
  legend = [t.get_text() for t in ax.get_legend().get_texts()]
  assert legend == ["kernel=softmax (mean, min-max of 2)", "kernel=elu1"]
  softmax = ax.get_lines()[0]
  assert list(softmax.get_ydata()) == [4.0, 9.0, 1.5]  # step 2: both runs' resumed 9.0
  (band,) = ax.collections
  ys = band.get_paths()[0].vertices[:, 1]
  assert min(ys) == 1.0 and max(ys) == 9.0 and 5.0 in ys and 3.0 in ys  # min-max of the seeds


@pytest.mark.parametrize(
    "args, needle",
    [
        (["{a}", "{missing}"], "metrics.jsonl not found: give the workdir of a train.py run."),
        (
            ["{a}", "--metrics", "test/loss"],
            "--metrics: no run has 'test/loss'; they have: "
            "train/loss, validation/accuracy, validation/loss.",
        ),
        (["{a}", "{a}", "--labels", "one"], "--labels has 1 entries for 2 workdirs."),
        (["{a}", "--out", "{root}/x.nope"], "--out="),
    ],
)
def test_bad_input_is_one_line(plot_curves, tmp_path, capsys, args, needle):
  a = _workdir(tmp_path, "a", "softmax", [3.0, 2.0, 1.0])
  argv = [x.format(a=a, missing=tmp_path / "missing", root=tmp_path) for x in args]
  assert plot_curves.main(argv) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and err.startswith("plot_curves: ")
  assert needle in err
