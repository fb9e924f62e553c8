"""``fusecli bench ORIGINAL FUSED``: time a fused model against its original, side by side
(the runner is fusecli.runtime.bench)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fusecli.commands.options import RUNTIME_PYTHON


def _mib(v) -> str:
    return "n/a" if v is None else f"{v / 2**20:.2f} MiB"


@click.command("bench")
@click.argument("original", type=click.Path(path_type=Path))
@click.argument("fused", type=click.Path(path_type=Path))
@click.option("--runs", type=click.IntRange(1, 1_000_000), default=20, show_default=True,
              help="Timed iterations per model (interleaved A B, B A, ...).")
@click.option("--warmup", type=click.IntRange(0, 100_000), default=3, show_default=True,
              help="Warm-up runs per model.")
@click.option("--threads", type=click.IntRange(1, 256), default=None,
              help="Intra-op threads for both sessions (default: the machine's CPU count).")
@click.option("--runtime-python", default=None, type=RUNTIME_PYTHON,
              help="Python interpreter whose onnxruntime runs the models (default: picked like "
                   "`fusecli verify`).")
@click.option("--dim", "dims", multiple=True, metavar="NAME=VALUE",
              help="Value of a symbolic input dimension (repeatable), e.g. --dim batch=4.")
@click.option("--feeds", "feeds_file", type=click.Path(path_type=Path),
              help="NumPy .npz of arrays keyed by graph input name; inputs it lacks are "
                   "generated as `fusecli verify` generates them.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def bench(original, fused, runs, warmup, threads, runtime_python, dims, feeds_file, as_json):
    """Time FUSED against ORIGINAL on the same feeds, interleaved, in one process.

    Prints median/min/max per model, the spread, the speed-up (original median / fused median)
    and the peak memory of one run of each. Spinning is off; medians of interleaved runs are the
    only fair comparison on small machines.
    """
    from fusecli.runtime.bench import run_bench, summary
    from fusecli.runtime.feeds import parse_dims

    res = run_bench(original, fused, runs=runs, warmup=warmup, threads=threads,
                    runtime_python=str(runtime_python) if runtime_python else None,
                    dims=parse_dims(dims), feeds_file=feeds_file)
    s = summary(res)
    if as_json:
        click.echo(json.dumps(s))
        return
    click.echo(f"{s['runtime']}, {s['threads']} intra-op threads, spinning off, "
               f"{warmup} warm-up + {s['runs']} interleaved runs each")
    click.echo("feeds: " + "; ".join(res["feed_lines"]))
    click.echo(f"{'model':<9} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'spread':>8} "
               f"{'peak memory':>12}")
    for key, path in (("original", original), ("fused", fused)):
        d = s[key]
        spread = (d["max_ms"] - d["min_ms"]) / d["median_ms"] if d["median_ms"] else 0.0
        click.echo(f"{key:<9} {d['median_ms']:>10.3f} {d['min_ms']:>9.3f} {d['max_ms']:>9.3f} "
                   f"{spread:>7.1%} {_mib(d['peak_bytes']):>12}   {path}")
    click.echo(f"speed-up: {s['speedup']:.3f}x (original median / fused median)")
    method = res["a"].get("peak_method")
    if method:
        click.echo(f"peak memory: {method}")
