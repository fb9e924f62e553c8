"""The benchmark suite (``make bench``) and its deep-graph generator.

- ``fusecli.bench.suite``: ``python -m fusecli.bench.suite --out BENCHMARKS.md`` measures;
  ``fusecli.bench.render`` writes its rows as BENCHMARKS.md.
- ``fusecli.bench.deepgraph``: deep training graphs (5k-40k nodes) for optimiser-speed runs.
- ``fusecli.bench.shapes``: the synthetic real-shape and outlier cases.
The ``fusecli bench`` command is ``fusecli.commands.bench`` over ``fusecli.runtime.bench``.
"""
