"""A fresh ``DecoderLM`` starts near a uniform guess: first loss ~ln(vocab) at every width.

Tied embeddings without a scale give the input token's own row a logit of ~0.7 * embed_dim
(the residual path keeps the token): a first loss of ~25 nats at width 32 and ~375 at 512.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastpos.models import TaskInfo, build_model, model_config

VOCAB, LENGTH = 142, 16


# (width, norm, tied embeddings): every case the tests below check.
CASES = [(w, n, True) for w in (32, 512) for n in ("post", "pre")] + [
    (w, "post", False) for w in (32, 512)
]


def _first_outputs(width: int, norm: str, tie: bool):
  """A function () -> (logits, decoded logits) of a fresh one-layer model on random inputs."""
  c = model_config()
  c.update(
      embed_dim=width,
      num_heads=2,
      mlp_dim=2 * width,
      num_layers=1,
      norm=norm,
      tie_embeddings=tie,
      dropout_rate=0.0,
  )
  model = build_model(c, TaskInfo(kind="lm", vocab_size=VOCAB, max_length=LENGTH))
  inputs = jax.random.randint(jax.random.key(1), (4, LENGTH), 1, VOCAB)

  def run():
    variables = model.init(jax.random.key(0), {"inputs": inputs})
    logits = model.apply(variables, {"inputs": inputs})
    cache = model.init_cache(4, LENGTH)
    decoded, _ = model.apply(
        {**variables, "cache": cache},
        {"inputs": inputs, "mask": jnp.ones(inputs.shape, bool)},
        decode=True,
        mutable=["cache"],
    )
    return logits, decoded

  return run


@pytest.fixture(scope="module")
def first_losses():
  """{case: (cross-entropy vs random targets, logits, decoded logits)} for every case, from ONE
  compiled program (one per case, or op by op, is slower)."""
  runs = {case: _first_outputs(*case) for case in CASES}
  outputs = jax.jit(lambda: {case: run() for case, run in runs.items()})()
  targets = jax.random.randint(jax.random.key(2), (4, LENGTH), 1, VOCAB)
  out = {}
  for case, (logits, decoded) in outputs.items():
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    loss = float(jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logit))
    out[case] = loss, logits, decoded
  return out


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("width", [32, 512])
def test_first_loss_near_uniform_tied(width, norm, first_losses):
  loss, logits, decoded = first_losses[width, norm, True]
  assert abs(loss - np.log(VOCAB)) < 0.2, (width, norm, loss, np.log(VOCAB))
  # decoding uses the same output projection (scale included)
  np.testing.assert_allclose(np.asarray(decoded), np.asarray(logits), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("width", [32, 512])
def test_first_loss_near_uniform_untied(width, first_losses):
  loss, _, _ = first_losses[width, "post", False]
  assert abs(loss - np.log(VOCAB)) < 0.75, (width, loss)  # std-1 logits: ~+0.5 nats
