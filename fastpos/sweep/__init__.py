"""Sweeps: a grid of config overrides, every combination trained, then scored on the test split.

``plan`` parses the grid and resolves each combination's config as train.py does, and says
which runs are finished; ``manifest`` keeps ``sweep.json``; ``runner`` runs train.py and
eval.py per combination (one after another, or several at a time: one per GPU, or CPU jobs);
``report`` prints the plan and the summary; ``cli`` is ``scripts/sweep.py``'s command line.
``tables`` is scripts/make_tables.py (the papers' layout), ``claim_table`` its claim layout
(paired differences and verdicts), ``stats`` their means, t-intervals and paired differences,
and ``claims`` the papers' claims as sweeps (scripts/claims.sh, docs/claims.md). Sweeps:

  scripts/sweep.sh --config=configs/listops_generated.py --sweep_dir=workdirs/listops_sweep \\
      arg.kernel=elu1,sikf arg.pos=none,fastrpb seed=0,1
  scripts/sweep.sh --config=configs/listops_generated.py --sweep_dir=workdirs/lg \\
      model.kernel=elu1,sikf model.positional=absolute,absolute+fastrpb seed=0,1

Each grid argument is ``key=v1,v2,...`` with ``key`` a config field (as in ``--config.key=v``
of train.py) or ``arg.<name>``, a field of the config file's argument (``get_config(arg)``:
``arg.kernel=dpfp,sikf`` runs ``--config=x.py:kernel=dpfp`` and ``--config=x.py:kernel=sikf``,
merged with the argument given in ``--config``, e.g. ``:tiny``); the papers' table configs
pick a table's cell this way (configs/fastrpb_table1.py: ``arg.task=text arg.kernel=dpfp,sikf``).
When a value itself holds a comma (``model.positional=absolute,fastrpb``; ``absolute+fastrpb``
also works), separate the values with ``|`` instead (quote it for the shell; a single value holding
commas ends with ``|``: ``'model.positional=absolute,fastrpb|'``). Every combination (the
Cartesian product, in the order given) gets its own workdir ``SWEEP_DIR/<name>``, its name
built from the overrides: ``model.kernel=elu1__model.positional=absolute+fastrpb__seed=0``
(``,`` -> ``+``, other characters outside ``[A-Za-z0-9._=+-]`` -> ``-``). A run is

  python train.py --config=CONFIG --workdir=WORKDIR --config.key=value ...
  python eval.py  --config=CONFIG --workdir=WORKDIR --config.key=value ... --split=test

with both outputs appended to ``WORKDIR/sweep.log``.

Before anything runs, each combination's config is resolved exactly as train.py resolves it
(ml_collections ``config_flags``): an unknown key stops the sweep with the nearby valid keys,
a value of the wrong type with the flag's error. ``SWEEP_DIR/sweep.json`` is the manifest:
the config, the grid and one record per run (overrides, workdir, log, status, return code,
wall time, the commands and the resolved config, which scripts/make_tables.py reads for runs
that never started); it is rewritten after every change of status.

Re-running the same command skips finished runs and resumes unfinished ones (train.py
resumes from the newest checkpoint by itself). A run is finished when its effective config
(its ``config.json`` with the changes its resumes recorded, read through the workdir's owner
``fastpos.train.workdir.Workdir``) equals the combination's resolved config, its newest
checkpoint is at ``num_train_steps``, and its ``results_test.json`` is newer than those config
records. A run that exits non-zero is recorded with
its log and a status read from train.py / eval.py's exit code (``fastpos/train/errors.py``):

  preempted   75: stopped by SIGTERM / SIGINT after saving a checkpoint; re-running the sweep
              resumes it;
  nonfinite   3: the loss became NaN / Inf; the last good checkpoint is kept (resuming it
              with the same settings will likely diverge again: change the config);
  locked      4: another trainer holds the workdir (another sweep on the same directory?);
  bad_input   2: a bad config, flag, data or workdir: the log's last line says which;
  failed      any other code (a bug: the log has the traceback).

The others go on; the summary at the end lists each kind apart. The sweep's exit status is
0 when every run is done, 1 when a run needs a fix (failed, nonfinite, locked, bad_input),
else 75 (``EXIT_PREEMPTED``) when runs were preempted, interrupted or not started: re-run
the same command to continue.

Modes:
  sequential  (default) one run after another in this process's environment;
  parallel    ``--jobs`` runs at a time (default 2) on this machine's CPUs, each with XLA
              limited to its share of the cores (``XLA_FLAGS``: ``intra_op_parallelism_threads``
              = cores // jobs, no multi-threaded Eigen), so that the runs do not oversubscribe;
  gpus        one run per GPU in parallel, each with CUDA_VISIBLE_DEVICES set to its GPU
              (the GPUs: ``--gpus=0,1``, else CUDA_VISIBLE_DEVICES, else ``nvidia-smi -L``;
              with none found the sweep stops with a message before running anything);
  print       prints one shell command per unfinished run (train then eval) and runs
              nothing: ``... --mode=print | xargs -P 4 -I{} sh -c '{}'`` or one line per
              task of a job array. Re-run with ``--mode=sequential`` (it skips the finished
              runs) or run scripts/make_tables.py directly afterwards.
``--dry_run`` shows what each mode would do (run / resume / skip, and in gpus mode which run
starts on which GPU) and writes nothing; it needs no GPU (on a machine without one, pass
``--gpus=0,1,...`` to see the assignment for those).

In the sequential and gpus modes the runs share a JAX persistent compilation cache
(``--compilation_cache``, by default ``SWEEP_DIR/jax_cache``): runs that differ only in their
seed compile their steps once. Printed commands set nothing (export JAX_COMPILATION_CACHE_DIR
for the jobs to share one).

Progress: after each run one line ``[progress] 5/12 cells done, 7 to run: about 9.5 min left,
mean 81 s per cell``, the time left from the mean wall time of the runs finished in this
invocation (divided among the runs at a time).

SIGTERM (a preempted job) and SIGINT (Ctrl-C) are passed on to the running trainings, which
save a checkpoint and stop; their runs are recorded as interrupted and the next invocation
resumes them.
"""
