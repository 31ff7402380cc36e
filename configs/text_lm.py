"""Your own text as a causal language-modelling task (fastpos.tasks.text_lm), in nanoGPT's
character-level CPU setting: bytes, 4 layers x 128, 4 heads, context 64, batch 12, 2000 steps.

Command: python train.py --config=configs/text_lm.py:paths=~/books --workdir=/tmp/fastpos_text_lm
The text is yours: no default ships with fastpos (no installed Python package holds a suitable
English text, and none is downloaded). Without ``paths=`` the run stops before any compute with
one line naming ``--config.task.paths=``. Several files / folders:
``--config.task.paths=a.txt,notes/``; a folder's files: ``--config.task.include='*.txt,*.md'``.
Arguments (comma-separated after a colon): ``tiny`` (a seconds-long run on the package's own
text sample, fastpos/tasks/samples/wikitext), ``paths=<file or folder>``, ``vim`` (the Vim user
manual that Debian's vim-runtime package installs, /usr/share/vim/vim90/doc/usr_*.txt: the
text of results/text_lm.md, where that package is installed), ``include=<patterns>``,
``level=<byte|word>``, ``vocab=<V>`` (word level), ``kernel=<softmax|elu1|...>``,
``pos=<absolute|rope|...>``, ``steps=<S>``.
Hardware: a shared 2-core CPU (results/text_lm.md gives each run's wall time and load).
Expected: results/text_lm.md (validation loss in nats per byte on the Vim user manual,
``configs/text_lm.py:vim``, beside nanoGPT's reported loss on Shakespeare: another text, so
side by side, not directly comparable).
Settings, as nanoGPT's config/train_shakespeare_char.py with its README's CPU overrides:
pre-LN GPT blocks, MLP 4x, tied embeddings, learned absolute positions, dropout 0, AdamW
(0.9, 0.99) with weight decay 0.1, lr 1e-3 after 100 warmup steps, cosine to 1e-4 at step 2000,
gradient clipping at 1. The split is the text's last 10% for validation (nanoGPT's 90 / 10;
test_fraction 0: no test split). Validation scores non-overlapping 64-byte segments, every
byte once with 0..63 bytes of context (nanoGPT's estimate draws random 64-byte windows, the
same context distribution).
"""

from __future__ import annotations

import os

import ml_collections

from configs import common

VIM_MANUAL = "/usr/share/vim/vim90/doc"
FIXTURES = os.path.join(common.FIXTURES_ROOT, "wikitext")  # the package's WikiText sample
ARGS = dict(
    tiny=False,
    paths="",
    vim=False,
    include="",
    level="byte",
    vocab=0,
    kernel="softmax",
    pos="absolute",
    steps=0,
)
CHOICES = dict(level=("byte", "word"))


def _default_vocab(level: str, tiny: bool) -> int:
  """Bytes need no vocabulary size; words keep the most frequent ones (the fixtures hold
  about 140 word types)."""
  return 0 if level == "byte" else (100 if tiny else 10000)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  a = common.parse_arg(arg, choices=CHOICES, **ARGS)
  c = common.base_config("text_lm")
  if a.vim and a.paths:
    raise ValueError("configs/text_lm.py: give paths=<file or folder> or vim, not both.")
  # No default text (module docstring): an empty paths stops the run naming the field.
  default_paths, default_include = "", "*.txt"
  if a.tiny:
    default_paths, default_include = FIXTURES, "*.tokens"
  if a.vim:
    default_paths, default_include = VIM_MANUAL, "usr_*.txt"
  c.task.update(
      paths=a.paths or default_paths,
      include=a.include or default_include,
      level=a.level,
      vocab_size=a.vocab or _default_vocab(a.level, a.tiny),
      validation_fraction=0.1,
      test_fraction=0.0,
      segment_length=64,
      eval_stride=0,
  )
  c.model.update(
      num_layers=4,
      embed_dim=128,
      num_heads=4,
      mlp_dim=512,
      dropout_rate=0.0,
      norm="pre",
      tie_embeddings=True,
      kernel=a.kernel,
      positional=a.pos,
  )
  c.batch_size = 12
  c.num_train_steps = 2000
  c.optimizer.update(
      learning_rate=1e-3, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1, grad_clip_norm=1.0
  )
  c.schedule.update(name="cosine", warmup_steps=100, end_factor=0.1)
  c.log_every_steps = 100
  c.eval_every_steps = c.checkpoint_every_steps = 250
  if a.tiny:
    c.model.update(num_layers=1, embed_dim=16, num_heads=2, mlp_dim=32)
    c.batch_size = 8
    c.num_train_steps = 20
    c.schedule.warmup_steps = 5
    c.log_every_steps = c.eval_every_steps = c.checkpoint_every_steps = 10
  if a.steps:
    c.num_train_steps = a.steps
    c.eval_every_steps = c.checkpoint_every_steps = min(c.eval_every_steps, a.steps)
  return c
