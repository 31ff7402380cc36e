"""The papers' central claims as sweeps, one command: ``scripts/claims.sh OUT_DIR``.

Each claim (``CLAIMS``) is one or more sweeps of a config over variants and seeds, and the
pairs of columns whose paired difference decides it (``"FastRPB>None"``: FastRPB is claimed
better than None). The command runs every sweep into ``OUT_DIR/<claim>/<sweep>`` (one run
after another, or ``--mode=parallel --jobs=2``), then writes ``RESULTS/<claim>.md`` (each cell's
mean with its 95% t-interval, the paired differences and verdicts: ``fastpos.sweep
.claim_table``), ``RESULTS/<claim>.png`` (each variant's mean and interval, and the
validation curves of the first seed) and ``RESULTS/README.md`` (the verdicts, the compute
spent, the machine and the command). Re-running the same command continues: finished runs
are skipped, interrupted ones resume from their checkpoints (``fastpos.sweep``). Ctrl-C stops
the runs cleanly; the tables are written from what is finished.

``--tiny`` is the smoke mode: each claim's smallest grid (1-2 variants of its ``:tiny``
config), 2 seeds, 2 training steps per run; its README says it measured nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from fastpos.sweep import claim_table, cli, tables
from fastpos.sweep.runner import REPO, format_duration, host_cpus
from fastpos.train import errors
from fastpos.train.workdir import Workdir


class SweepSpec(NamedTuple):
  """One sweep of a claim: ``config`` (``configs/x.py``), its full ``grid`` (seeds apart) and
  the ``tiny`` grid of the smoke mode (None: not in the smoke mode). ``skipped``: why the
  default run leaves it out (None: it runs); ``--all`` runs it too."""

  name: str
  config: str
  grid: tuple[str, ...]
  tiny: tuple[str, ...] | None
  skipped: str | None = None


class PaperTable(NamedTuple):
  """What a paper reported for a claim: the ``RESULTS`` (``{"row|col": value}``) of the
  config file ``config`` (the paper's table, one source of its numbers), its ``title`` and
  the ``columns`` the claim's tasks match."""

  config: str
  title: str
  columns: tuple[str, ...]


class Figure(NamedTuple):
  """A figure of a claim that a benchmark (not a sweep) makes: ``file`` in the results folder,
  what it shows and the ``command`` that remakes it (from the repository root)."""

  file: str
  caption: str
  command: str


class Claim(NamedTuple):
  """A paper's claim: its statement, its sweeps, ``compare`` (``"CLAIM>BASELINE"`` column
  labels, as ``make_tables.py --compare``) and ``papers``, the papers' own tables printed
  beside ours (cells of our tables that the paper's table has show its number inline)."""

  name: str
  statement: str
  sweeps: tuple[SweepSpec, ...]
  compare: tuple[str, ...]
  papers: tuple[PaperTable, ...] = ()
  figures: tuple[Figure, ...] = ()


_LRPE = ("Type1", "Type2", "Type3")
PATHFINDER_AT_CHANCE = (
    "at this CPU's budget every Pathfinder-32 model stays at chance, so the sweep could decide "
    "nothing (a run takes about 1.6 h here): ELU+1 without FastRPB, 3,000 steps of 128 images "
    "on the LRA setting (14 paddles), ended at 51.2% test accuracy, and ELU+1 + FastRPB, 1,500 "
    "steps on the easiest setting (6 paddles), at 50.2% validation accuracy (the majority "
    "class: 51.15%; pathfinder_at_chance.md has both runs' curves). The papers' setting "
    "(configs/common.py, LRA_TASKS) trains on 200 x 312 batches of 512 images, about 80 times "
    "the images of the first run"
)
CLAIMS: tuple[Claim, ...] = (
    Claim(
        "fastrpb",
        "FastRPB (Zubkov et al.): adding FastRPB to linear attention (ELU+1, SIKF, Performer's "
        "FAVOR+) improves accuracy.",
        (
            SweepSpec(
                "listops",
                "configs/listops_generated.py",
                ("arg.kernel=elu1,sikf,favor", "arg.pos=none,fastrpb"),
                ("arg.kernel=elu1", "arg.pos=none,fastrpb"),
            ),
            # 2D FastRPB on Pathfinder-32: measured to stay at chance at this budget.
            SweepSpec(
                "pathfinder",
                "configs/pathfinder_generated.py",
                ("arg.kernel=elu1,sikf,favor", "arg.pos=none,fastrpb"),
                None,
                skipped=PATHFINDER_AT_CHANCE,
            ),
        ),
        ("FastRPB>None",),
        (),
        (
            Figure(
                "fastrpb_memory.png",
                "The memory claim (FastRPB's Figure 3a): train-step memory against N, softmax "
                "attention against linear attention + FastRPB, the same model otherwise "
                "(benchmarks/memory_length.md has the numbers and the ratios).",
                "python -m benchmarks memory_length --out=benchmarks "
                "--figure=results/claims/fastrpb_memory.png",
            ),
        ),
    ),
    Claim(
        "kernelized_rpe",
        "Kernelized RPE (Luo et al. 2021): NPRF attention with kernelized RPE has a lower "
        "perplexity than NPRF alone and than softmax attention.",
        (
            SweepSpec(
                "text_lm",
                "configs/claim_text_lm.py",
                ("arg.model=softmax,nprf,nprf_rpe",),
                ("arg.model=nprf,nprf_rpe",),
            ),
            SweepSpec(
                "pathfinder",
                "configs/claim_pathfinder.py",
                ("arg.model=softmax,nprf,nprf_rpe",),
                None,
                skipped=PATHFINDER_AT_CHANCE,
            ),
        ),
        (
            "NPRF-Transformer w/ RPE>NPRF-Transformer",
            "NPRF-Transformer w/ RPE>Vanilla Transformer",
        ),
        (
            PaperTable(
                "configs/wikitext103_nprf_table2.py",
                "Luo et al. Table 2: WikiText-103 validation perplexity, 512 tokens, 6 layers",
                ("WikiText-103",),
            ),
        ),
    ),
    Claim(
        "lrpe",
        "LRPE (Qin et al. 2023): linear attention (ELU+1) with LRPE types 1-3 beats no "
        "positional encoding and RoPE.",
        (
            SweepSpec(
                "listops",
                "configs/claim_listops.py",
                ("arg.model=base,rope,lrpe1,lrpe2,lrpe3",),
                ("arg.model=base,lrpe1",),
            ),
            SweepSpec(
                "text_lm",
                "configs/claim_text_lm.py",
                ("arg.model=base,rope,lrpe1,lrpe2,lrpe3",),
                None,
            ),
            SweepSpec(
                "pathfinder",
                "configs/claim_pathfinder.py",
                ("arg.model=base,rope,lrpe1,lrpe2,lrpe3",),
                None,
                skipped=PATHFINDER_AT_CHANCE,
            ),
        ),
        tuple(f"{t}>Base" for t in _LRPE) + tuple(f"{t}>RoPE" for t in _LRPE),
        (
            PaperTable(
                "configs/lrpe_table4.py",
                "LRPE Table 4: LRA test accuracy (%)",
                ("ListOps", "Pathfinder"),
            ),
        ),
    ),
    Claim(
        "permuteformer",
        "PermuteFormer (Chen 2021): PermuteFormer beats Performer and comes close to (or "
        "beats) the softmax Transformer.",
        (
            SweepSpec(
                "listops",
                "configs/claim_listops.py",
                ("arg.model=transformer,performer,permuteformer",),
                ("arg.model=performer,permuteformer",),
            ),
            SweepSpec(
                "text_lm",
                "configs/claim_text_lm.py",
                ("arg.model=transformer,performer,permuteformer",),
                None,
            ),
        ),
        ("PermuteFormer>Performer", "PermuteFormer>Transformer"),
        (
            PaperTable(
                "configs/wikitext103_permuteformer_table4.py",
                "PermuteFormer Table 4: WikiText-103 test perplexity, 512 tokens",
                ("WikiText-103",),
            ),
        ),
    ),
    Claim(
        "txl_memory",
        "Transformer-XL (Dai et al. 2019): the segment memory lowers perplexity, the more so "
        "the shorter the context.",
        (
            SweepSpec(
                "text_lm",
                "configs/claim_text_lm.py",
                ("arg.model=txl", "arg.context=16,32,64", "arg.memory=false,true"),
                ("arg.model=txl", "arg.context=16", "arg.memory=false,true"),
            ),
        ),
        ("Transformer-XL rel. + memory>Transformer-XL rel.",),
    ),
)
BY_NAME = {c.name: c for c in CLAIMS}


def _parser() -> argparse.ArgumentParser:
  p = cli._OneLineParser(  # pylint: disable=protected-access  (one parser style for both)
      description="Runs the papers' claims (fastpos.sweep.claims), then their tables, "
      "figures and README."
  )
  p.add_argument("out_dir", type=Path, help="the sweeps' workdirs go here (OUT_DIR/<claim>/)")
  p.add_argument(
      "--results",
      type=Path,
      default=REPO / "results" / "claims",
      help="tables, figures and README (default: the checkout's results/claims)",
  )
  p.add_argument("--claims", default=",".join(BY_NAME), help="comma-separated claim names")
  p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 per cell")
  # Sequential by default: two runs at a time were slower on the shared 2-core machine this
  # was written on (docs/claims.md, "Budget").
  p.add_argument("--mode", default="sequential", choices=("sequential", "parallel"))
  p.add_argument("--jobs", type=int, default=2, help="--mode=parallel: runs at a time")
  p.add_argument("--tiny", action="store_true", help="smoke mode (module docstring)")
  p.add_argument(
      "--all", action="store_true", help="also the sweeps the default run skips (each says why)"
  )
  p.add_argument("--tables_only", action="store_true", help="run nothing; tables from the runs")
  return p


def skipped_here(args: argparse.Namespace, spec: SweepSpec) -> bool:
  """Whether this mode leaves out a sweep skipped by default (``spec.skipped``): the full
  run without ``--all`` does; the smoke mode has its own grids."""
  return spec.skipped is not None and not args.all and not args.tiny


def sweep_argv(args: argparse.Namespace, claim: Claim, spec: SweepSpec) -> list[str] | None:
  """``scripts/sweep.py``'s arguments for one sweep of a claim; None when the mode skips it
  (no tiny grid) or its config file is absent."""
  grid = spec.tiny if args.tiny else spec.grid
  if grid is None or not (REPO / spec.config).is_file() or skipped_here(args, spec):
    return None
  seeds = 2 if args.tiny else args.seeds
  extra = ["num_train_steps=2"] if args.tiny else []
  mode = [f"--mode={args.mode}"] + ([f"--jobs={args.jobs}"] if args.mode == "parallel" else [])
  return [
      f"--config={REPO / spec.config}" + (":tiny" if args.tiny else ""),
      f"--sweep_dir={args.out_dir / claim.name / spec.name}",
      *mode,
      *grid,
      *extra,
      f"seed={','.join(map(str, range(seeds)))}",
  ]


def run_sweeps(args: argparse.Namespace, claims: list[Claim]) -> int:
  """Runs every sweep; returns the first non-zero exit code that stops the pipeline (an
  interruption: ``EXIT_PREEMPTED``), else 1 when a run needs a fix, else 0."""
  worst = 0
  for claim in claims:
    for spec in claim.sweeps:
      argv = sweep_argv(args, claim, spec)
      if argv is None:
        if args.tiny:
          why = "not in the smoke mode"
        elif skipped_here(args, spec):
          why = f"{spec.skipped}; --all runs it"
        else:
          why = f"{spec.config} is absent"
        print(f"claims: {claim.name}/{spec.name}: skipped ({why})", flush=True)
        continue
      print(f"claims: {claim.name}/{spec.name}: scripts/sweep.py {shlex.join(argv)}", flush=True)
      code = cli.main(argv)
      if code == errors.EXIT_PREEMPTED:
        return code  # interrupted: the same command continues
      if code == errors.EXIT_BAD_INPUT:
        raise ValueError(f"{claim.name}/{spec.name}: the sweep refused its arguments (above).")
      worst = max(worst, code)
  return worst


def claim_blocks(args: argparse.Namespace, claim: Claim) -> list[dict]:
  """The claim's blocks (``fastpos.sweep.tables``), each with its ``records``
  (``claim_table.compare_block``: the pairs whose two columns the block has)."""
  runs: list[dict] = []
  for spec in claim.sweeps:
    if sweep_argv(args, claim, spec) is None:
      continue  # not in this mode's run: its table would only show missing cells
    d = args.out_dir / claim.name / spec.name
    if (d / "sweep.json").exists():
      runs += tables.read_sweep(d, "test")[1]
  if not runs:
    return []
  blocks = tables.build_blocks(runs, tables.ROW, tables.COL, "seed")
  for b in blocks:
    b["metric"] = tables.block_metric(b, None)
    cols = {str(c) for c in b["cols"]}
    compare = [p for p in claim.compare if all(x in cols for x in p.split(">"))]
    pairs = claim_table.parse_compare(compare, None, b["cols"])
    b["records"] = claim_table.compare_block(b, pairs, better=None, seed_key="seed")
  return blocks


def paper_markdown(paper: PaperTable) -> str:
  """The paper's own numbers for a claim: the rows of ``paper.config``'s ``RESULTS`` in the
  claim's ``columns``, as a markdown table."""
  from fastpos.train import config_files  # pylint: disable=import-outside-toplevel

  results = config_files.load_module(str(REPO / paper.config)).RESULTS
  rows = list(dict.fromkeys(k.split("|", 1)[0] for k in results))
  lines = [
      f"### What the paper reported: {paper.title} (`{paper.config}`)",
      "",
      "| row | " + " | ".join(paper.columns) + " |",
      "|---|" + "---|" * len(paper.columns),
  ]
  for row in rows:
    cells = [tables.paper_text(results.get(f"{row}|{c}"), 2, False) for c in paper.columns]
    if any(f"{row}|{c}" in results for c in paper.columns):
      lines.append(f"| {row} | " + " | ".join(cells) + " |")
  lines += [
      "",
      "The paper's setting is far larger than ours (its data, length and model): compare "
      "the direction of a difference, not its size.",
      "",
  ]
  return "\n".join(lines)


def figures_markdown(claim: Claim, results: Path) -> list[str]:
  """A claim's benchmark figures: linked where ``results`` has them, else the command that
  makes them."""
  lines = []
  for f in claim.figures:
    shown = f"![{f.file}]({f.file})" if (results / f.file).is_file() else "not yet made"
    lines += [f"### {f.file}", "", f"{f.caption} {shown}; command: `{f.command}`.", ""]
  return lines


def claim_markdown(
    claim: Claim, blocks: list[dict], command: str, results: Path, skipped: tuple = ()
) -> str:
  """``RESULTS/<claim>.md``: the statement, the command, why the ``skipped`` sweeps did not
  run, a table per block, the benchmark figures and the papers' own tables."""
  head = [f"# Claim: {claim.name}", "", claim.statement, "", f"Command: `{command}`", ""]
  head += [f"Not run: the {s.name} sweep (`{s.config}`): {s.skipped}.\n" for s in skipped]
  papers = figures_markdown(claim, results) + [paper_markdown(p) for p in claim.papers]
  if not blocks:
    return "\n".join(head + ["Not yet run: no run of this claim has a workdir.", ""] + papers)
  body = [
      claim_table.markdown_block(b, b["records"], row_name="setting", digits=2, split="test")
      for b in blocks
  ]
  return "\n".join(head + body + papers)


def plot_claim(claim: Claim, blocks: list[dict], out: Path) -> bool:
  """``out``: a panel per block, each variant's mean and 95% interval per row (x: the rows,
  e.g. context lengths); False when no run has results."""
  import matplotlib  # pylint: disable=import-outside-toplevel  (figures only)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  from fastpos.plots import distinct_colors  # pylint: disable=import-outside-toplevel

  blocks = [b for b in blocks if any(r["cell"] for r in b["records"])]
  if not blocks:
    return False
  fig, axes = plt.subplots(1, len(blocks), figsize=(5.2 * len(blocks), 3.8), squeeze=False)
  for ax, b in zip(axes[0], blocks):
    cols = list(b["cols"])
    colors = dict(zip(cols, distinct_colors(len(cols))))
    width = 0.8 / len(cols)
    for j, c in enumerate(cols):
      xs, ys, errs = [], [], [[], []]
      for i, rv in enumerate(b["rows"]):
        cell = next((r["cell"] for r in b["records"] if r["row"] == rv and r["col"] == c), None)
        if cell is None:
          continue
        xs.append(i - 0.4 + width * (j + 0.5))
        ys.append(cell.mean)
        errs[0].append(cell.mean - (cell.lo if cell.lo is not None else cell.mean))
        errs[1].append((cell.hi if cell.hi is not None else cell.mean) - cell.mean)
      ax.errorbar(xs, ys, yerr=errs, fmt="o", capsize=3, color=colors[c], label=str(c))
    ax.set_xticks(range(len(b["rows"])), [str(r) for r in b["rows"]])
    scale = " (%)" if b["metric"] in tables.PERCENT_METRICS else ""
    ax.set_ylabel(f"test {b['metric']}{scale}: mean, 95% interval")
    ax.set_title(b["title"], fontsize="medium")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")
  fig.suptitle(f"Claim: {claim.name}")
  fig.tight_layout()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return True


def plot_curves(args: argparse.Namespace, claim: Claim, spec: SweepSpec, out: Path) -> bool:
  """``out``: the training and validation curves of every variant of one sweep of the claim,
  its seeds' mean and min-max band (scripts/plot_curves.py; a claim of training stability
  reads it); False when no run has metrics."""
  sweep_dir = args.out_dir / claim.name / spec.name
  workdirs = sorted(
      p
      for p in (sweep_dir.iterdir() if sweep_dir.is_dir() else ())
      if p.is_dir() and Workdir(p).metrics_file.exists()
  )
  if not workdirs:
    return False
  title = f"Claim {claim.name}, {spec.name}: each variant's seeds (mean, min-max)"
  proc = subprocess.run(
      [sys.executable, str(REPO / "scripts" / "plot_curves.py"), *map(str, workdirs)]
      + [f"--out={out}", f"--title={title}"],
      capture_output=True,
      text=True,
      check=False,
  )
  if proc.returncode:
    print(f"claims: {claim.name}/{spec.name}: no curves ({proc.stderr.strip()})", file=sys.stderr)
  return proc.returncode == 0


def compute_spent(args: argparse.Namespace, claims: list[Claim]) -> tuple[float, int, int]:
  """(seconds of run wall time, runs done, runs recorded) over the manifests of the claims'
  sweeps that this mode runs."""
  wall, done, total = 0.0, 0, 0
  for claim in claims:
    for spec in claim.sweeps:
      if sweep_argv(args, claim, spec) is None:
        continue  # not in this mode's run
      path = args.out_dir / claim.name / spec.name / "sweep.json"
      if path.exists():
        for rec in json.loads(path.read_text())["runs"].values():
          total += 1
          done += rec.get("status") == "done"
          wall += rec.get("wall_s") or 0.0
  return wall, done, total


def readme(args: argparse.Namespace, claims: list[Claim], verdicts: dict, command: str) -> str:
  """``RESULTS/README.md``: what ran (or "not yet run"), where, for how long, and the
  verdicts."""
  wall, done, total = compute_spent(args, claims)
  lines = ["# The papers' claims, measured", "", f"Command: `{command}`", ""]
  if args.tiny:
    lines += [
        "**Smoke mode (--tiny): 2 training steps per run, 2 seeds. These numbers measure "
        "nothing; they show that the pipeline runs.**",
        "",
    ]
  if not done:
    lines += ["Status: not yet run (no run has finished).", ""]
  else:
    lines += [
        f"Status: {done} of {total} runs finished"
        + (" (re-run the command to continue)." if done < total else "."),
        "",
        f"Compute: {format_duration(wall)} of run wall time (train + eval, summed over the "
        "runs" + (f"; {args.jobs} at a time)." if args.mode == "parallel" else ")."),
        "",
        f"Machine: {host_cpus()} CPU cores ({_cpu()}), "
        f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}.",
        "",
    ]
  lines += [
      "| claim | comparison | setting | difference [95% CI] | paper's difference | verdict |",
      "|---|---|---|---|---|---|",
  ]
  for claim in claims:
    rows = verdicts.get(claim.name) or [("", "", "", "", "not yet run")]
    for comparison, setting, difference, paper, verdict in rows:
      lines.append(
          f"| [{claim.name}]({claim.name}.md) | {comparison} | {setting} | {difference} "
          f"| {paper} | {verdict} |"
      )
  for claim in claims:
    for f in claim.figures:
      made = (args.results / f.file).is_file()
      lines += ["", f"[{f.file}]({f.file})" if made else f"{f.file} (not yet made)"]
      lines[-1] += f": {f.caption} Command: `{f.command}`."
  lines += [
      "",
      "Each claim's table gives every cell's mean with its 95% t-interval over seeds and the "
      "paired difference (the same seeds) against its baseline, beside the paper's own number "
      "and difference where its table has the cell (–: it has none; the papers ran other "
      "sizes, so compare directions, not values); docs/claims.md explains the verdicts and "
      "how to resume.",
      "",
  ]
  return "\n".join(lines)


def _difference_text(record: dict) -> str:
  """A record's paired difference as ``7.47 [5.16, 9.77] (n=3)``; empty without one."""
  d = record["difference"]
  return f"{tables.format_interval(d, 2)} (n={d.n})" if d is not None else ""


def _cpu() -> str:
  from fastpos.plots import cpu_name  # pylint: disable=import-outside-toplevel

  return cpu_name()


def write_results(args: argparse.Namespace, command: str) -> None:
  """The tables, figures and README of every claim (from what ``args.out_dir`` holds; "not
  yet run" for a claim without runs) into ``args.results``."""
  args.results.mkdir(parents=True, exist_ok=True)
  verdicts: dict[str, list[tuple[str, str, str]]] = {}
  for claim in CLAIMS:
    blocks = claim_blocks(args, claim)
    skipped = tuple(s for s in claim.sweeps if skipped_here(args, s))
    (args.results / f"{claim.name}.md").write_text(
        claim_markdown(claim, blocks, command, args.results, skipped)
    )
    plot_claim(claim, blocks, args.results / f"{claim.name}.png")
    for spec in claim.sweeps:
      if sweep_argv(args, claim, spec) is not None:  # the sweeps this mode runs
        plot_curves(args, claim, spec, args.results / f"{claim.name}_{spec.name}_curves.png")
    verdicts[claim.name] = [
        (
            f"{r['col']} > {r['vs']}",
            f"{b['title']}: {r['row']}",
            _difference_text(r),
            claim_table.paper_difference_text(r["paper_difference"], b["higher_is_better"], 2),
            r["verdict"],
        )
        for b in blocks
        for r in b["records"]
        if r["vs"] is not None
    ] + [
        (
            " / ".join(c.replace(">", " > ") for c in claim.compare),
            f"{s.name} (`{s.config}`)",
            "–",
            "–",
            "not run (its page)",
        )
        for s in skipped
    ]
  (args.results / "README.md").write_text(readme(args, list(CLAIMS), verdicts, command))
  print(f"claims: tables, figures and README in {args.results}", flush=True)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = _parser().parse_args(argv)
  args.out_dir = args.out_dir.expanduser().absolute()
  args.results = args.results.expanduser().absolute()
  names = [n.strip() for n in args.claims.split(",") if n.strip()]
  unknown = [n for n in names if n not in BY_NAME]
  if unknown or not names:
    print(
        f"claims: unknown claim {', '.join(unknown) or '(none given)'}; valid: "
        f"{', '.join(BY_NAME)}.",
        file=sys.stderr,
    )
    return errors.EXIT_BAD_INPUT
  if args.seeds < 2 or args.jobs < 1:
    print(f"claims: --seeds={args.seeds} (>= 2) / --jobs={args.jobs} (>= 1).", file=sys.stderr)
    return errors.EXIT_BAD_INPUT
  claims = [BY_NAME[n] for n in names]
  # The command that runs the claims (a --tables_only call reports that command's runs).
  command = shlex.join(["scripts/claims.sh", *(a for a in argv if a != "--tables_only")])
  code = 0
  if not args.tables_only:
    try:
      code = run_sweeps(args, claims)
    except ValueError as e:
      print(f"claims: {e}", file=sys.stderr)
      return errors.EXIT_BAD_INPUT
  write_results(args, command)
  if code == errors.EXIT_PREEMPTED:
    print("claims: interrupted; re-run the same command to continue.", file=sys.stderr)
  return code


if __name__ == "__main__":
  sys.exit(main())
