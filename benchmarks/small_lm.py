"""A small language model on the CPU: fastpos's train step against a plain Flax GPT.

``python -m benchmarks small_lm --out benchmarks`` times, side by side in one process
(interleaved rounds, medians), on ``configs/text_lm.py`` (nanoGPT's character-level CPU recipe:
4 layers x 128, 4 heads, context 64, batch 12, AdamW):

- ``fastpos``: the jitted train step the trainer runs (``fastpos.train.run.build_run``: the
  model, clipping, the schedule, the metrics, the donated state);
- ``fastpos model, plain step``: the same model and optimizer under a minimal step (the mean
  loss, no metrics): what the step machinery costs;
- ``Flax GPT (einsum)`` / ``Flax GPT (dot_product_attention)``: a plain Flax GPT of the same
  size (token + position embedding, 4 pre-LN blocks, causal softmax attention written as two
  einsums or through ``jax.nn.dot_product_attention``, MLP 512, tied output) under the same
  optimizer (``fastpos.train.state.make_optimizer``) and the minimal step;
- ``loop``: what the trainer's loop adds to the bare step each step: the next batch from the
  training feed (grain), its device transfer and the step, the host never more than two steps
  ahead (as ``fastpos.train.loop``), against the same step on one fixed batch;
- evaluation: one exact evaluation of the validation split (``Run.evaluate_split``) against
  the loop's steps, as a share of a run's step and evaluation time; and the same evaluation
  with other evaluation batches (``--eval-batches``) against the config's.

Each round runs every case for ``--steps`` steps; the table gives the medians over
``--rounds`` rounds and each case's ratio to the plain Flax GPT. On a shared machine only the
ratios mean something. Writes ``<out>/small_lm.md`` and ``.json`` (``benchmarks.report``);
``--smoke`` runs the tiny text config (``configs/text_lm.py:tiny``) for a few steps and
writes nowhere unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from benchmarks import report
from configs import text_lm
from fastpos.train import run as run_lib
from fastpos.train import sharding as sharding_lib

PLAIN = "Flax GPT (einsum)"
DPA = "Flax GPT (dot_product_attention)"


class _Block(nn.Module):
  """Pre-LN GPT block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``; x ``[b, N, D]``."""

  heads: int
  mlp_dim: int
  attention: str  # "einsum" or "dpa" (jax.nn.dot_product_attention)

  @nn.compact
  def __call__(self, x):
    b, n, d = x.shape
    qkv = nn.Dense(3 * d)(nn.LayerNorm()(x)).reshape(b, n, 3, self.heads, d // self.heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [b, N, heads, dim]
    if self.attention == "dpa":
      y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    else:
      s = jnp.einsum("bihd,bjhd->bhij", q, k) * (d // self.heads) ** -0.5
      s = jnp.where(jnp.tril(jnp.ones((1, 1, n, n), bool)), s, jnp.finfo(s.dtype).min)
      y = jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(s, axis=-1), v)
    x = x + nn.Dense(d)(y.reshape(b, n, d))
    h = nn.Dense(self.mlp_dim)(nn.LayerNorm()(x))
    return x + nn.Dense(d)(nn.gelu(h))


class FlaxGPT(nn.Module):
  """A plain GPT: ids ``[b, N]`` int32 -> logits ``[b, N, vocab]`` float32 (tied output)."""

  vocab: int
  length: int
  layers: int
  width: int
  heads: int
  mlp_dim: int
  attention: str = "einsum"

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(self.vocab, self.width)
    pos = self.param("pos", nn.initializers.normal(0.02), (self.length, self.width))
    x = embed(ids) + pos[None, : ids.shape[1]]
    for _ in range(self.layers):
      x = _Block(self.heads, self.mlp_dim, self.attention)(x)
    return embed.attend(nn.LayerNorm()(x))


def _plain_step(apply: Callable, tx: optax.GradientTransformation) -> Callable:
  """``step((params, opt_state), batch) -> ((params, opt_state), loss)``: the mean
  cross-entropy over every token, its gradient, one optimizer update; nothing else."""

  def step(carry, batch):
    params, opt_state = carry

    def loss_fn(p):
      logits = apply(p, batch)
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return jax.jit(step, donate_argnums=0)


def build(arg: str, workdir: str) -> run_lib.Run:
  """The run of ``configs/text_lm.py:<arg>`` (nothing compiled, nothing written)."""
  return run_lib.build_run(text_lm.get_config(arg), workdir)


def step_cases(run: run_lib.Run) -> dict[str, Callable[[], Callable[[], object]]]:
  """name -> a maker of a closure that runs one step (on a fixed batch) and returns what to
  block on. The makers build the state, so each case owns its buffers."""
  cfg = run.cfg
  train = run.feed.train(run.task.source("train"), 0)
  local = next(train)
  batch = sharding_lib.global_batch(local, run.shardings.batch)
  info = run.info

  def fastpos():
    state, carry = run.init_state()
    box = [state]

    def one():
      box[0], metrics, _ = run.train_step(box[0], batch, carry, run.train_rng)
      return metrics

    return one

  def fastpos_plain():
    state, _ = run.init_state()
    collections = state.collections
    apply = lambda p, b: run.model.apply({"params": p, **collections}, {"inputs": b["inputs"]})
    return _looped(_plain_step(apply, run.tx), (state.params, state.opt_state), batch)

  def gpt(attention: str):
    def make():
      model = FlaxGPT(
          vocab=info.vocab_size,
          length=info.max_length,
          layers=cfg.model.num_layers,
          width=cfg.model.embed_dim,
          heads=cfg.model.num_heads,
          mlp_dim=cfg.model.mlp_dim,
          attention=attention,
      )
      params = model.init(jax.random.PRNGKey(cfg.seed), batch["inputs"])["params"]
      apply = lambda p, b: model.apply({"params": p}, b["inputs"])
      return _looped(_plain_step(apply, run.tx), (params, run.tx.init(params)), batch)

    return make

  return {
      "fastpos": fastpos,
      "fastpos model, plain step": fastpos_plain,
      PLAIN: gpt("einsum"),
      DPA: gpt("dpa"),
  }


def _looped(step: Callable, carry, batch) -> Callable[[], object]:
  box = [carry]

  def one():
    box[0], loss = step(box[0], batch)
    return loss

  return one


def loop_case(run: run_lib.Run) -> Callable[[], object]:
  """One step as the trainer's loop takes it: the next batch from the training feed, its
  device transfer, the step; the host waits for the step before the previous one."""
  state, carry = run.init_state()
  train = run.feed.train(run.task.source("train"), 0)
  box = {"state": state, "last": None}

  def one():
    batch = sharding_lib.global_batch(next(train), run.shardings.batch)
    box["state"], metrics, _ = run.train_step(box["state"], batch, carry, run.train_rng)
    if box["last"] is not None:
      jax.block_until_ready(box["last"])
    box["last"] = metrics
    return None

  return one


def time_rounds(cases: dict[str, Callable[[], object]], reps: dict[str, int], rounds: int):
  """Runs case k ``reps[k]`` times per round, the cases in turn, for ``rounds`` rounds (after
  one untimed round: compiling, warming up). Returns (wall, cpu): name -> seconds per run, one
  value per round; cpu is this process's CPU time (all threads), which leaves out the time
  its threads waited for a core on a shared machine."""
  wall, cpu = {k: [] for k in cases}, {k: [] for k in cases}
  for r in range(rounds + 1):
    for name, one in cases.items():
      jax.block_until_ready(one())
      t0, c0 = time.perf_counter(), time.process_time()
      for _ in range(reps[name]):
        out = one()
      jax.block_until_ready(out)
      if r:
        wall[name].append((time.perf_counter() - t0) / reps[name])
        cpu[name].append((time.process_time() - c0) / reps[name])
  return wall, cpu


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks small_lm", description=__doc__.split("\n\n")[0]
  )
  p.add_argument("--steps", type=int, default=20, help="steps per case per round")
  p.add_argument("--rounds", type=int, default=7, help="timed rounds")
  p.add_argument("--out", default="", help="folder for small_lm.md / .json (default: none)")
  p.add_argument(
      "--eval-batches",
      default="48,192",
      help="comma-separated evaluation batch sizes timed beside the config's ('' for none)",
  )
  p.add_argument("--smoke", action="store_true", help="the tiny text config, few steps")
  args = p.parse_args(argv)
  for name in ("steps", "rounds"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1; got {getattr(args, name)}.")
  try:
    args.eval_batches = [int(b) for b in args.eval_batches.split(",") if b.strip()]
  except ValueError:
    args.eval_batches = [0]
  if any(b < 1 for b in args.eval_batches):
    p.error(f"--eval-batches must be comma-separated integers >= 1; got {args.eval_batches!r}.")
  if args.smoke:
    args.steps, args.rounds = min(args.steps, 2), min(args.rounds, 1)
    args.eval_batches = args.eval_batches[:1] and [3]
  return args


def eval_cases(run: run_lib.Run, batches: list[int]) -> dict[str, Callable[[], object]]:
  """One exact evaluation of the validation split (``Run.evaluate_split``, every token) with
  the config's evaluation batch ("evaluation") and with each of ``batches`` rows."""
  state, _ = run.init_state()
  cases = {"evaluation": lambda: run.evaluate_split(state, "validation")}
  for rows in batches:
    cfg = run.cfg.copy_and_resolve_references()
    cfg.eval_batch_size = rows
    other = run_lib.build_run(cfg, run.workdir, run.model)
    cases[f"evaluation, batch {rows}"] = lambda r=other: r.evaluate_split(state, "validation")
  return cases


def summary(wall: dict, cpu: dict, cfg: ml_collections.ConfigDict) -> dict:
  """Medians, ratios to the plain Flax GPT, the loop's overhead and the evaluation share."""
  med = {k: float(np.median(v)) for k, v in wall.items()}
  cmed = {k: float(np.median(v)) for k, v in cpu.items()}
  rows = {
      k: {
          "ms_per_step": 1e3 * med[k],
          "cpu_ms_per_step": 1e3 * cmed[k],
          "ratio": med[k] / med[PLAIN],
          "cpu_ratio": cmed[k] / cmed[PLAIN],
      }
      for k in med
      if k != "loop" and not k.startswith("evaluation")
  }
  evals = -(-cfg.num_train_steps // cfg.eval_every_steps)

  def share(m):  # evaluations / (training + evaluations) of a run of the config
    e, t = evals * m["evaluation"], cfg.num_train_steps * m["loop"]
    return e / (e + t)

  return {
      "steps": rows,
      "loop_over_step": med["loop"] / med["fastpos"],
      "loop_over_step_cpu": cmed["loop"] / cmed["fastpos"],
      "evaluation_s": med["evaluation"],
      "evaluation_by_batch": {
          k.split("batch ")[1]: {
              "s": med[k],
              "cpu_s": cmed[k],
              "ratio": med[k] / med["evaluation"],
              "cpu_ratio": cmed[k] / cmed["evaluation"],
          }
          for k in med
          if k.startswith("evaluation, batch")
      },
      "evaluation_cpu_s": cmed["evaluation"],
      "evaluation_in_train_steps": med["evaluation"] / med["loop"],
      "evaluations_per_run": evals,
      "evaluation_share": share(med),
      "evaluation_share_cpu": share(cmed),
  }


def markdown(res: dict, run_info: dict, cfg: ml_collections.ConfigDict, args) -> str:
  s = res["summary"]
  lines = [
      "# A small LM on the CPU: fastpos's train step against a plain Flax GPT",
      "",
      report.provenance(run_info) + f"; load average at the end {res['load_after']}.",
      "",
      f"`configs/text_lm.py{':tiny' if args.smoke else ''}`: {cfg.model.num_layers} layers x "
      f"{cfg.model.embed_dim}, {cfg.model.num_heads} heads, MLP {cfg.model.mlp_dim}, context "
      f"{res['length']}, batch {cfg.batch_size}, eval batch {cfg.eval_batch_size or cfg.batch_size}"
      f"; {args.rounds} interleaved rounds of {args.steps} steps per case, medians. Wall: seconds "
      "on the clock; CPU: this process's CPU time (all threads), which leaves out time spent "
      "waiting for a core on a shared machine.",
      "",
      "| train step | ms / step (wall) | vs Flax GPT (wall) | ms / step (CPU) "
      "| vs Flax GPT (CPU) |",
      "|---|---|---|---|---|",
  ]
  for k, r in s["steps"].items():
    lines.append(
        f"| {k} | {r['ms_per_step']:.1f} | {r['ratio']:.2f}x | {r['cpu_ms_per_step']:.1f} | "
        f"{r['cpu_ratio']:.2f}x |"
    )
  lines += [
      "",
      f"The trainer's loop (next batch from the grain feed, device transfer, step) over the "
      f"bare step: {s['loop_over_step']:.2f}x wall, {s['loop_over_step_cpu']:.2f}x CPU.",
      "",
      f"One exact evaluation of the validation split ({res['eval_tokens']:,} tokens): "
      f"{s['evaluation_s']:.2f} s wall, {s['evaluation_cpu_s']:.2f} s CPU, "
      f"{s['evaluation_in_train_steps']:.0f} loop steps' time; with "
      f"{s['evaluations_per_run']} evaluations in {cfg.num_train_steps} steps, evaluation is "
      f"{100 * s['evaluation_share']:.1f}% of the run's step and evaluation time (wall; "
      f"{100 * s['evaluation_share_cpu']:.1f}% CPU).",
  ]
  by = s["evaluation_by_batch"]
  if by:
    lines += [
        "",
        "The same evaluation with other evaluation batches (each against the config's):",
        "",
        "| eval batch | s (wall) | vs config (wall) | s (CPU) | vs config (CPU) |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {k} | {r['s']:.2f} | {r['ratio']:.2f}x | {r['cpu_s']:.2f} | {r['cpu_ratio']:.2f}x |"
        for k, r in by.items()
    ]
  return "\n".join(lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  run_info = report.run_record("small_lm", argv)
  with tempfile.TemporaryDirectory() as workdir:
    run = build("tiny" if args.smoke else "", workdir)
    cases = {k: make() for k, make in step_cases(run).items()}
    cases["loop"] = loop_case(run)
    cases.update(eval_cases(run, args.eval_batches))
    reps = {k: 1 if k.startswith("evaluation") else args.steps for k in cases}
    wall, cpu = time_rounds(cases, reps, args.rounds)
    eval_tokens = int(cases["evaluation"]()["num_examples"])
  res = {
      "run": run_info,
      "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg()),
      "length": run.info.max_length,
      "eval_tokens": eval_tokens,
      "args": {"steps": args.steps, "rounds": args.rounds, "smoke": args.smoke},
      "wall_s": wall,
      "cpu_s": cpu,
      "summary": summary(wall, cpu, run.cfg),
  }
  text = markdown(res, run_info, run.cfg, args)
  print(text)
  report.write(args.out, "small_lm", text, res)
  return 0


if __name__ == "__main__":
  sys.exit(main())
