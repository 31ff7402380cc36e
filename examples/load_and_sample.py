"""Load a trained workdir and sample from it.

Without ``--workdir`` the script first trains a tiny word-level language model on the
repository's text fixtures into a temporary folder, as you would from the shell::

    python train.py --config=configs/text_lm.py:tiny,level=word,kernel=elu1,pos=rope \\
        --workdir=/tmp/fastpos_words

then restores it (``fastpos.load``: the best checkpoint, digest-verified, on however many
devices this process has), samples a continuation of a prompt (``fastpos.generate``) and
checks that the cached decoding's logits equal the model's full causal forward.

Run: python examples/load_and_sample.py [--workdir DIR --prompt "the" --num_tokens 12]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import jax.numpy as jnp
import numpy as np

import fastpos

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/text_lm.py:tiny,level=word,kernel=elu1,pos=rope"


def train_tiny(workdir: str, steps: int) -> None:
  """A tiny run with train.py (the repository's text fixtures; seconds on a CPU)."""
  cmd = [sys.executable, "train.py", f"--config={CONFIG},steps={steps}", f"--workdir={workdir}"]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  if out.returncode:
    raise SystemExit(f"train.py failed ({out.returncode}): {out.stderr.strip().splitlines()[-1]}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", help="a workdir train.py wrote (default: train a tiny one)")
  parser.add_argument("--steps", type=int, default=10, help="training steps of the tiny run")
  parser.add_argument("--prompt", default="the", help="words of the run's vocabulary")
  parser.add_argument("--num_tokens", type=int, default=12)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    workdir = args.workdir
    if workdir is None:
      workdir = os.path.join(tmp, "run")
      train_tiny(workdir, args.steps)

    model, params, config, task = fastpos.load(workdir)
    vocab = task.vocabulary()  # words by id (word-level tasks); None for bytes
    ids = {w: i for i, w in enumerate(vocab)}
    prompt = jnp.array([[ids[w] for w in args.prompt.split()]])  # [1, P]
    tokens, logits = fastpos.generate(
        model,
        params,
        prompt,
        args.num_tokens,
        temperature=0.8,
        top_k=20,
        seed=0,
        return_logits=True,
    )  # tokens [1, num_tokens], logits [1, P + num_tokens - 1, vocab]
    print(
        f"{config.task.name}: {type(model).__name__}, kernel {config.model.kernel}, "
        f"positional {config.model.positional}"
    )
    print(f"{args.prompt} -> {' '.join(vocab[int(i)] for i in tokens[0])}")

    seq = jnp.concatenate([prompt, tokens[:, :-1]], axis=1)
    full = model.apply({"params": params}, {"inputs": seq})
    err = float(jnp.max(jnp.abs(logits - full)) / jnp.max(jnp.abs(full)))
    print(f"cached decoding vs full forward: relative difference {err:.1e}")
    assert tokens.shape == (1, args.num_tokens)
    assert np.all((np.asarray(tokens) > 0) & (np.asarray(tokens) < len(vocab)))
    assert err < 1e-4, err


if __name__ == "__main__":
  main()
