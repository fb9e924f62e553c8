"""Benchmarks: `fusecli bench`, the deep-graph generator and the suite.

- ``fusecli.bench.command``: the ``bench`` click command and :func:`run_bench` (original vs fused
  model, timed side by side in one process of the model's runtime by ``fusecli/bench_worker.py``).
- ``fusecli.bench.deepgraph``: deep training graphs (5k-40k nodes) for optimiser-speed runs.
- ``fusecli.bench.suite``: ``python -m fusecli.bench.suite --out BENCHMARKS.md`` (``make bench``)
  measures; ``fusecli.bench.render`` writes its rows as BENCHMARKS.md.
"""

from __future__ import annotations

from .command import bench, run_bench

__all__ = ["bench", "run_bench"]
