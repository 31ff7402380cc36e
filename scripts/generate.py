"""Samples from a trained language model: ``python scripts/generate.py --workdir=DIR
--prompt="the game" --num_tokens=50 [--temperature=1 --top_k=0 --top_p=1 --seed=0 --check]``.

A thin command line over the library: ``fastpos.load`` restores the workdir's checkpoint
(digest-verified, on any device count; its ``config.json`` unless ``--config`` names another;
``--config.<field>=<value>`` overrides apply) and ``fastpos.api.generation`` (``fastpos.generate``'s
sampler) feeds the prompt to the model's decoding cache in one prefill call, then samples
``--num_tokens`` tokens one cached step at a time (one compiled ``lax.scan``); it prints the
text and the decoding speed in tokens/s. The prompt is whitespace-separated words of the
task's vocabulary (WikiText-103) or integer token ids (any LM task; id 0 is padding).
``--check`` runs the full causal forward over prompt + sample and prints the largest relative
difference from the cached logits; above ``--tolerance`` it exits 1.

Exit codes as ``eval.py``'s: 0 done, 2 bad flag, config, prompt or workdir (one line on
stderr), 1 a failed ``--check`` (one line) or an unexpected error (its traceback).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastpos import interrupts  # noqa: E402

if __name__ == "__main__":  # the program (not an import of it, as tests do)
  interrupts.install("generate.py")  # first: SIGINT / SIGTERM stop with one line at any instant

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from fastpos import config_schema  # noqa: E402
from fastpos.api import generation, loading  # noqa: E402
from fastpos.api.generation import sample_logits  # noqa: E402,F401  (the sampler, re-exported)
from fastpos.train import cli, errors, program, sharding  # noqa: E402
from fastpos.train.workdir import Workdir  # noqa: E402

_CONFIG = cli.define_config_flag(
    "the config the workdir was trained with; default: <workdir>/config.json. "
    "Override fields with --config.<field>=<value>"
)
_WORKDIR = flags.DEFINE_string("workdir", None, "a workdir written by train.py (an lm task)")
_PROMPT = flags.DEFINE_string(
    "prompt", None, "whitespace-separated words of the task's " "vocabulary, or integer token ids"
)
_NUM_TOKENS = flags.DEFINE_integer("num_tokens", 20, "tokens to sample after the prompt")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "softmax temperature; 0 = greedy")
_TOP_K = flags.DEFINE_integer("top_k", 0, "sample among the k likeliest tokens (0: all)")
_TOP_P = flags.DEFINE_float(
    "top_p",
    1.0,
    "nucleus sampling: the smallest set of tokens " "whose probability reaches p (1: all)",
)
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_CHECK = flags.DEFINE_bool("check", False, "compare the cached logits with a full forward")
_TOLERANCE = flags.DEFINE_float("tolerance", 1e-4, "largest relative difference --check " "accepts")
_CHECKPOINT = flags.DEFINE_enum(
    "checkpoint", "best", ["best", "latest"], "best on validation, or the newest checkpoint"
)


class CheckFailed(errors.RunError):
  """The cached logits differ from the full forward by more than the tolerance."""

  exit_code = errors.EXIT_FAILED


def restore(workdir: str, cfg, checkpoint: str) -> loading.Loaded:
  """The trained run (``fastpos.load``: digest-verified, any device count); an lm task only."""
  loaded = loading.load(workdir, checkpoint=checkpoint, config=cfg)
  kind = loaded.task.info.kind
  if kind != "lm":
    raise errors.RunError(
        f"--workdir={workdir} holds a {kind!r} model (task {cfg.task.name!r}); generate.py "
        "samples from lm tasks."
    )
  print(f"restored {loaded.checkpoint} (step {loaded.step})")
  return loaded


def vocabulary(task):
  """The task's words by id, or None for a task without words (ids only)."""
  get = getattr(task, "vocabulary", None)
  return get() if callable(get) else None


def encode_prompt(text: str, vocab, vocab_size: int) -> np.ndarray:
  pieces = text.split()
  if not pieces:
    raise errors.RunError("--prompt is empty; give at least one word or token id.")
  if all(p.lstrip("-").isdigit() for p in pieces):
    bad = [int(p) for p in pieces if not 1 <= int(p) < vocab_size]  # before int32 can overflow
    if bad:
      raise errors.RunError(
          f"--prompt: token id {bad[0]} is out of range; ids are 1.."
          f"{vocab_size - 1} (0 is padding)."
      )
    return np.asarray([int(p) for p in pieces], np.int32)
  if vocab is None:
    raise errors.RunError(
        f"--prompt={text!r}: this task has no vocabulary of words; give "
        f"integer token ids 1..{vocab_size - 1}."
    )
  lookup = {w: i for i, w in enumerate(vocab) if i}
  unknown = [p for p in pieces if p not in lookup]
  if unknown:
    raise errors.RunError(
        f"--prompt: {unknown[0]!r} is not in the task's vocabulary of "
        f"{len(vocab)} words (they are case-sensitive; rare words are "
        f"<unk>)."
    )
  return np.asarray([lookup[p] for p in pieces], np.int32)


# The flags' valid values, declared as config fields are (fastpos.config_schema).
FLAG_SCHEMA = {
    "num_tokens": config_schema.Field("int", low=1),
    "temperature": config_schema.Field(
        "float", low=0, high=generation.MAX_TEMPERATURE
    ),  # 0: greedy
    "top_k": config_schema.Field("int", low=0),  # 0 = no top-k cut
    "top_p": config_schema.Field("float", low=0, high=1, low_open=True),  # 1 = no nucleus cut
    "seed": config_schema.Field("int", low=0, high=2**32 - 1),
    "tolerance": config_schema.Field("float", low=0, low_open=True),
}


def check_flags(num_tokens, temperature, top_k, top_p, tolerance, seed=0):
  """RunError (one line: the flag, its valid values, the value) for a flag out of range."""
  try:
    config_schema.check_flags(
        dict(
            num_tokens=num_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            tolerance=tolerance,
            seed=seed,
        ),
        FLAG_SCHEMA,
    )
  except config_schema.ConfigValueError as e:
    raise errors.RunError(str(e)) from None


def main(argv: list[str]) -> int:
  program.no_extra_args(argv)
  workdir = program.require("workdir", _WORKDIR.value, "--workdir=/tmp/fastpos_run")
  prompt_text = program.require("prompt", _PROMPT.value, '--prompt="the game" or --prompt="5 9 2"')
  check_flags(
      _NUM_TOKENS.value,
      _TEMPERATURE.value,
      _TOP_K.value,
      _TOP_P.value,
      _TOLERANCE.value,
      _SEED.value,
  )
  # One message for a folder that is not a run's (fastpos.train.workdir): a --config given,
  # or the run's config.json that cli.with_saved_config put on the command line.
  Workdir(workdir).require_run(config_given=_CONFIG.value is not None)
  cfg = cli.config_of(_CONFIG)  # checked against the schema before anything is built
  sharding.maybe_initialize_distributed()
  loaded = restore(workdir, cfg, _CHECKPOINT.value)
  model, variables = loaded.model, loaded.variables
  vocab = vocabulary(loaded.task)
  prompt = encode_prompt(prompt_text, vocab, model.vocab_size)
  n = _NUM_TOKENS.value
  total = len(prompt) + n
  if total > model.attention.max_length:
    raise errors.RunError(
        f"--prompt ({len(prompt)} tokens) + --num_tokens={n} = {total} "
        f"exceeds the model's max_length {model.attention.max_length}; "
        "shorten them."
    )
  gen = generation.make_generate(
      model, n, temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value
  )
  cache = model.init_cache(1, total)
  prompt_ids = jnp.asarray(prompt)[None]
  key = jax.random.key(_SEED.value)
  args = (variables, cache, prompt_ids, jnp.ones(prompt_ids.shape, bool), key)
  start = time.perf_counter()
  compiled = gen.lower(*args).compile()
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  tokens, logits = jax.block_until_ready(compiled(*args))
  seconds = time.perf_counter() - start
  tokens = np.asarray(tokens[0])
  words = [vocab[int(i)] for i in tokens] if vocab is not None else [str(int(i)) for i in tokens]
  print(f"prompt: {' '.join(vocab[int(i)] for i in prompt) if vocab else prompt_text}")
  print(f"sample: {' '.join(words)}")
  print(
      f"decoding: {total} tokens ({len(prompt)} prompt + {n} sampled) in {seconds:.3f} s: "
      f"{total / seconds:.1f} tokens/s (compiled in {compile_s:.1f} s)"
  )
  if _CHECK.value:
    seq = jnp.concatenate([jnp.asarray(prompt), jnp.asarray(tokens[:-1])])[None]
    full = model.apply(variables, {"inputs": seq, "mask": jnp.ones(seq.shape, bool)})
    full = full[0] if isinstance(full, tuple) else full
    full, cached = np.asarray(full, np.float64), np.asarray(logits, np.float64)
    err = float(np.max(np.abs(cached - full)) / np.max(np.abs(full)))
    print(
        f"check: max relative difference of the cached logits from the full forward "
        f"{err:.3g} (tolerance {_TOLERANCE.value:g})"
    )
    if not err <= _TOLERANCE.value:
      raise CheckFailed(
          f"--check: the cached logits differ from the full forward by "
          f"{err:.3g} > --tolerance={_TOLERANCE.value:g}."
      )
  return errors.EXIT_OK


if __name__ == "__main__":
  program.run(main, "generate.py", cli.with_saved_config)
