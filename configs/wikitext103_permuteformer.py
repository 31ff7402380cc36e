"""WikiText-103 causal language modelling: PermuteFormer Table 4, one row per model
(Transformer, Performer, PermuteFormer, and its ablations without r and without P_pi).

Command: python train.py --config=configs/wikitext103_permuteformer.py --workdir=/tmp/wt103_permuteformer
Rows:    python train.py --config=configs/wikitext103_permuteformer.py:model=no_r (model: transformer performer permuteformer no_r no_perm) --workdir=/tmp/wt103_no_r
Then:    python eval.py --config=configs/wikitext103_permuteformer.py --workdir=/tmp/wt103_permuteformer --split=test
Data:    python scripts/download_data.py wikitext103 (the word-level release; the vocabulary and
         id streams are cached on first use).
Hardware: one or more GPUs (the paper: fairseq on 8 V100s; 50k steps of 64 x 512 tokens);
":tiny" builds a small model (segments of 64, 1000 words) for a CPU check (data still needed).
Paper: PermuteFormer (Chen 2021) Table 4, test perplexity: Transformer 30.18, Performer 36.87,
PermuteFormer 32.49, w/o r 35.76, w/o P_pi 33.08. The paper counts only the last 256 tokens
of each segment; eval.py scores every token of non-overlapping segments (a harder setting).
Settings: fastpos/train/experiments.py (WIKITEXT_PERMUTEFORMER_SETTINGS / _ROWS): fairseq's
transformer_lm recipe with the paper's sizes; the kernel of the PermuteFormer rows is ReLU
features, as for PermuteFormer's LRA rows.
"""

from __future__ import annotations

import ml_collections

from fastpos.train import experiments


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return experiments.wikitext_permuteformer_table4(arg)
