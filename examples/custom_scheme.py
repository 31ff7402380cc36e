"""A positional scheme of your own, registered from outside the package: ALiBi.

ALiBi (Press et al. 2022, "Train Short, Test Long") adds ``-m_h |i - j|`` to the softmax
logits of head h, with slopes ``m_h = 2^(-slope_base * h / H)``, h = 1..H. It acts at the
``logits`` hook, so fastpos's compatibility rules pair it with the softmax kernel only.

The script registers it with ``fastpos.register_scheme``, then checks that the layer's output
equals ALiBi attention written out by hand (float64: the bias sits where the hook says),
that linear kernels are refused with the reason, that its option shows up in the options
table, and that a causal model with it decodes token by token to its full forward.

Run: python examples/custom_scheme.py
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import fastpos
from fastpos.positional import compatibility, option_table


@fastpos.register_scheme
class Alibi(fastpos.Scheme):
  """ALiBi: ``logits(q, k, ctx) -> [1, heads, Lq, Lk]``, ``-m_h |i - j|``. No parameters."""

  scheme_name = "alibi"
  hooks = ("logits",)
  option_spec = {
      "slope_base": fastpos.Option(
          8.0, "slopes 2^(-slope_base h / H)", type="number", low=0, low_open=True, note="ALiBi: 8"
      ),
  }

  def logits(self, q, k, ctx):
    lq, lk = q.shape[1], k.shape[1]
    # Decoding: queries at offset + i, keys at cache slots; else queries after M memory keys.
    first = ctx.offset if ctx.offset is not None else ctx.memory_length
    dist = jnp.abs(first + jnp.arange(lq)[:, None] - jnp.arange(lk)[None, :])
    h = self.dims.num_heads
    slopes = 2.0 ** (-self.slope_base * jnp.arange(1, h + 1) / h)
    return -(slopes[:, None, None] * dist[None]).astype(q.dtype)[None]


def alibi_by_hand(params, x, heads: int, slope_base: float):
  """Softmax attention with the ALiBi bias, from the layer's projection weights."""
  p = params["params"]
  proj = lambda name: jnp.einsum("bnd,dhe->bnhe", x, p[name]["kernel"]) + p[name]["bias"]
  q, k, v = proj("query"), proj("key"), proj("value")
  n, d = x.shape[1], q.shape[-1]
  slopes = 2.0 ** (-slope_base * jnp.arange(1, heads + 1) / heads)
  bias = -slopes[:, None, None] * jnp.abs(jnp.arange(n)[:, None] - jnp.arange(n)[None, :])
  weights = jax.nn.softmax(jnp.einsum("bihe,bjhe->bhij", q, k) / jnp.sqrt(d) + bias, axis=-1)
  out = jnp.einsum("bhij,bjhe->bihe", weights, v)
  return jnp.einsum("bihe,hed->bid", out, p["out"]["kernel"]) + p["out"]["bias"]


def check_dense(width: int, heads: int, length: int) -> float:
  layer = fastpos.attention(
      width, heads, positional="alibi", alibi={"slope_base": 4.0}, dtype=jnp.float64
  )
  x = jax.random.normal(jax.random.key(0), (2, length, width), jnp.float64)
  init = jax.jit(layer.init)  # one compiled program each, not one per operation
  params = jax.tree.map(lambda a: a.astype(jnp.float64), init(jax.random.key(1), x))
  got = jax.jit(layer.apply)(params, x)
  want = alibi_by_hand(params, x, heads, 4.0)
  return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def check_decoding(width: int, heads: int, length: int) -> float:
  cfg = fastpos.attention_config(
      width, heads, positional=("rope", "alibi"), causal=True, max_length=length
  )
  model = fastpos.DecoderLM(cfg, vocab_size=11, num_layers=2, mlp_dim=2 * width)
  tokens = jax.random.randint(jax.random.key(2), (2, length), 1, 11)
  variables = jax.jit(model.init)(jax.random.key(3), {"inputs": tokens})
  steps = fastpos.generate(model, variables, tokens[:, :4], length - 4, return_logits=True)
  # The sampled tokens differ from `tokens`: hold the decoded logits to the forward of the
  # sequence that was decoded.
  seq = jnp.concatenate([tokens[:, :4], steps[0][:, :-1]], axis=1)
  full = jax.jit(model.apply)(variables, {"inputs": seq})
  return float(jnp.max(jnp.abs(steps[1] - full)) / jnp.max(jnp.abs(full)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--width", type=int, default=32)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--length", type=int, default=24)
  args = parser.parse_args()
  jax.config.update("jax_enable_x64", True)  # the float64 comparison

  err = check_dense(args.width, args.heads, args.length)
  print(f"alibi layer vs ALiBi by hand (float64): relative error {err:.1e}")
  assert err < 1e-9, err

  why = compatibility.problem("elu1", "alibi")
  print(f"elu1 x alibi: {why}")
  assert why is not None and "softmax" in why
  try:
    fastpos.attention(args.width, args.heads, kernel="elu1", positional="alibi")
    raise AssertionError("a linear kernel with alibi was not refused")
  except ValueError as e:
    assert "alibi" in str(e)

  rows = [r for r in option_table.rows() if r[0] == "alibi"]
  print(f"options table: {rows}")
  assert [r[1] for r in rows] == ["slope_base"]

  err = check_decoding(args.width, args.heads, args.length)
  print(f"causal DecoderLM with rope + alibi: decoded vs full forward, relative error {err:.1e}")
  assert err < 1e-4, err


if __name__ == "__main__":
  main()
