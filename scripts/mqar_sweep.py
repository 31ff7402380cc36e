"""The MQAR table of results/mqar.md: kernels x positional schemes x sequence lengths.

  python scripts/mqar_sweep.py --out=workdirs/mqar_sweep [--steps=600 --pairs=4 \\
      --kernels=softmax,elu1,sikf,favor --schemes=none,rope,fastrpb,kernelized_rpe,permuteformer \\
      --seq_lens=64,256 --extra=<configs/mqar.py argument, e.g. variant=copy>]

Every cell trains ``configs/mqar.py:kernel=K,pos=S,seq_len=N,pairs=P,steps=T`` in one process
(``fastpos.train.trainer.train_and_evaluate``; no per-run start-up), in its own workdir
``OUT/K__S__N``, then scores the best checkpoint on the test split. Finished cells (a
``results_test.json``) are skipped, so a re-run continues an interrupted sweep. Each result is
appended to ``OUT/results.jsonl`` as it finishes, and ``OUT/table.md`` (answer accuracy on the
test split, one row per kernel, one column per scheme and length) is rewritten after each.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "sweep folder (one workdir per cell)")
_STEPS = flags.DEFINE_integer("steps", 600, "training steps per cell")
_PAIRS = flags.DEFINE_integer("pairs", 4, "MQAR key-value pairs")
_KERNELS = flags.DEFINE_list("kernels", ["softmax", "elu1", "sikf", "favor"], "kernels")
_SCHEMES = flags.DEFINE_list(
    "schemes", ["none", "rope", "fastrpb", "kernelized_rpe", "permuteformer"], "positional schemes"
)
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["64", "256"], "sequence lengths")
_EXTRA = flags.DEFINE_string("extra", "", "more configs/mqar.py arguments (a,b=c)")


def table(rows: list[dict], kernels, schemes, seq_lens) -> str:
  acc = {(r["kernel"], r["pos"], r["seq_len"]): r for r in rows}
  head = [f"{s} N={n}" for n in seq_lens for s in schemes]
  lines = ["| kernel | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
  for k in kernels:
    cells = []
    for n in seq_lens:
      for s in schemes:
        r = acc.get((k, s, int(n)))
        cells.append(
            ""
            if r is None
            else (f"{r['accuracy']:.3f}" if "accuracy" in r else r.get("error", "error"))
        )
    lines.append(f"| {k} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  import importlib.util

  from fastpos.train import trainer

  if not _OUT.value:
    raise app.UsageError("--out is required")
  spec = importlib.util.spec_from_file_location(
      "mqar_config", os.path.join(os.path.dirname(__file__), "..", "configs", "mqar.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  os.makedirs(_OUT.value, exist_ok=True)
  log = os.path.join(_OUT.value, "results.jsonl")
  rows = []
  if os.path.exists(log):
    with open(log) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  done = {(r["kernel"], r["pos"], r["seq_len"]) for r in rows}
  for n in _SEQ_LENS.value:
    for k in _KERNELS.value:
      for s in _SCHEMES.value:
        if (k, s, int(n)) in done:
          continue
        arg = f"kernel={k},pos={s},seq_len={n},pairs={_PAIRS.value},steps={_STEPS.value}"
        arg += f",{_EXTRA.value}" if _EXTRA.value else ""
        cfg = module.get_config(arg)
        workdir = os.path.join(_OUT.value, f"{k}__{s}__{n}")
        start = time.time()
        row = dict(kernel=k, pos=s, seq_len=int(n), config=f"configs/mqar.py:{arg}")
        try:
          out = trainer.train_and_evaluate(cfg, workdir)
          if out.get("signal"):  # SIGTERM / Ctrl-C: the trainer saved; stop the sweep
            print(f"stopped by {out['signal']}; re-run to continue", flush=True)
            return
          res = trainer.evaluate(cfg, workdir, "test")
          row.update(accuracy=float(res["accuracy"]), loss=float(res["loss"]))
        except Exception as e:  # a failed cell is recorded, the sweep goes on
          row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["seconds"] = round(time.time() - start, 1)
        rows.append(row)
        with open(log, "a") as f:
          f.write(json.dumps(row) + "\n")
        with open(os.path.join(_OUT.value, "table.md"), "w") as f:
          f.write(table(rows, _KERNELS.value, _SCHEMES.value, _SEQ_LENS.value))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
  app.run(main)
