#!/usr/bin/env bash
# The script of the recorded million-token run on the lent GPU machine (benchmarks/million.md),
# kept as it ran but for the benchmark's command (then python -m fastpos.bench.million, now
# python -m benchmarks million). .gpu/ was a local, untracked folder sent with the run: the
# ml_collections wheel and tensorboardX (absent there), and import-only stand-ins for grain and
# orbax (a module whose every attribute is a do-nothing class: the benchmark's train step never calls
# them). To rerun on a machine with the repository's requirements installed, only the two
# python -m benchmarks million commands below are needed.
export PYTHONPATH=$PWD/.gpu/whl/ml_collections-1.1.0-py3-none-any.whl:$PWD/.gpu/site
python -c "import tensorboardX" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$PWD/.gpu/site2
python -c "import grain" 2>/dev/null || { echo "grain: import-only stand-in"; export PYTHONPATH=$PYTHONPATH:$PWD/.gpu/stub_grain; }
python -c "import orbax.checkpoint" 2>/dev/null || { echo "orbax: import-only stand-in"; export PYTHONPATH=$PYTHONPATH:$PWD/.gpu/stub_orbax; }
python -c "import benchmarks.million; print('imports ok')"
nproc; free -g | head -2; nvidia-smi -L
export PYTHONUNBUFFERED=1
echo "== 1M step on one GPU"; date -u
timeout 170 python -m benchmarks million --seq=1 --positions=learned --remat=block --mlp_chunk=2048 --attn_chunk=2048 --breakdown=0 --run=always --budget=139 --out=$OUT/gpu1m > $OUT/gpu1m.log 2>&1; echo "rc=$?"; grep -v cuda_timer $OUT/gpu1m.log | tail -25
echo "== 1M step over 8 simulated CPU devices"; date -u
JAX_PLATFORMS=cpu timeout 330 python -m benchmarks million --seq=8 --positions=learned --remat=block --mlp_chunk=2048 --attn_chunk=2048 --breakdown=0 --run=always --out=$OUT/cpu1m > $OUT/cpu1m.log 2>&1; echo "rc=$?"; tail -25 $OUT/cpu1m.log; date -u
