"""nbaccel's benchmarks against the other ways to launch training from a notebook.

Run ``python -m benchmarks`` from the repository root (``--smoke`` for a one-repetition check,
``--only launch,steps,iopub,failure,rss,gpu`` for some sections). Needs the benchmark extra
(``pip install -c constraints.txt accelerate tqdm``); contenders whose package is missing are
reported as unavailable. Results go to ``benchmarks/results/latest.{json,md}``.

Modules: ``workload`` (the training function every contender runs), ``harness`` (kernels,
launch cells, statistics), one module per section, ``report`` (markdown), ``__main__`` (runner).
"""
