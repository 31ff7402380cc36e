"""WikiText-103 causal language modelling: Luo et al. (2021) Table 2, NPRF attention with
kernelized RPE (FFT) against softmax, ELU+1 and TRF baselines.

Command: python train.py --config=configs/wikitext103_nprf_rpe.py --workdir=/tmp/wt103_nprf_rpe
Rows:    python train.py --config=configs/wikitext103_nprf_rpe.py:model=trf (model: vanilla linear trf nprf_rpe) --workdir=/tmp/wt103_trf
Then:    python eval.py --config=configs/wikitext103_nprf_rpe.py --workdir=/tmp/wt103_nprf_rpe --split=validation
Data:    python scripts/download_data.py wikitext103
Hardware: GPUs (the paper: 8 V100s, 150k steps of 64 x 512 tokens); ":tiny" builds a small
model (segments of 64, 1000 words) for a CPU check (data still needed).
Paper: Luo et al. 2021, "Stable, Fast and Accurate: Kernelized Attention with Relative
Positional Encoding", Table 2, validation perplexity: NPRF w/ RPE 30.6, vanilla Transformer
33.0, Linear Transformer 38.4, TRF 33.6 (TRF-GATE, 31.3, is not built here).
Settings: fastpos/train/experiments.py (WIKITEXT_NPRF_SETTINGS / _ROWS): the paper's Sec. 4.2
values; sinusoidal absolute positions in every row (fairseq's default).
"""

from __future__ import annotations

import ml_collections

from fastpos.train import experiments


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return experiments.wikitext_nprf_table2(arg)
