"""The benchmark suite (``make bench``) and its deep-graph generator.

- ``fusecli.bench.suite``: ``python -m fusecli.bench.suite --out BENCHMARKS.md``, the driver
  (arguments, sections, render); ``fusecli.bench.render`` writes its rows as BENCHMARKS.md.
- the sections, one module each: ``ops`` (a: per fused op, with its floors), ``steps`` (b, d, g:
  whole training steps), ``optimizer`` (c: optimiser speed and start-up), ``cases`` (e, f: the
  synthetic cases); beneath them ``samples`` (the benchmark samples: names, generation, fusing,
  probing) and ``measure`` (timing rules, the pair context, copy bandwidth, profiles).
- ``fusecli.bench.deepgraph``: deep training graphs (5k-40k nodes) for optimiser-speed runs.
- ``fusecli.bench.shapes``: the synthetic real-shape and outlier cases.
The ``fusecli bench`` command is ``fusecli.commands.bench`` over ``fusecli.runtime.bench``.
"""
