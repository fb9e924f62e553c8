"""The fusecli command line: one click group over the commands in this package, each a thin
module over the Python API (fusecli.api); this module maps errors to exit codes.

Exit codes (shared by every command): 0 success; 1 a check failed; 2 bad input or usage;
3 a CI expectation was not met; 4 internal error; 5 verify could not judge (inconclusive).
"""

from __future__ import annotations

import os
import signal
import sys

import click

from fusecli import errors
from fusecli.commands.bench import bench
from fusecli.commands.explain import explain
from fusecli.commands.ops import library_path_cmd, ops_cmd
from fusecli.commands.optimize import optimize
from fusecli.commands.output import one_line
from fusecli.commands.report import report
from fusecli.commands.rules import rules_group
from fusecli.commands.stats import stats
from fusecli.commands.verify import verify
from fusecli.errors import FuseError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fusecli")
def cli():
    """Fuse backward chains of ONNX training graphs into fused custom ops.

    Rules are YAML files (rules/); fused ops run through fusecli's onnxruntime custom-op
    library (`fusecli library-path`).
    """


for _command in (optimize, verify, stats, explain, report, rules_group, bench, ops_cmd,
                 library_path_cmd):
    cli.add_command(_command)


def _on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
    # the first SIGINT/SIGTERM unwinds (temporary files are removed on the way); later ones are
    # ignored so that the clean-up is not cut short and no traceback is printed
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise errors.Interrupted(signum)


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _error(msg: str) -> None:
    try:
        click.echo(f"fusecli: {one_line(msg)}", err=True)
    except (OSError, ValueError):      # stderr closed too: the exit code says it
        pass


def main(argv=None) -> int:
    for sig in _SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, _on_signal)     # an ignored signal (nohup) stays ignored
    try:
        return _main(argv)
    except errors.Interrupted as exc:
        _error(f"interrupted by {signal.Signals(exc.signum).name}; nothing half-written was "
               "left behind")
        return exc.exit_code


def _main(argv) -> int:
    if sys.stdout is None:         # started with file descriptor 1 closed
        return _stdout_closed()
    try:
        cli.main(args=argv, prog_name="fusecli", standalone_mode=False)
        sys.stdout.flush()
        return errors.EXIT_OK
    except FuseError as exc:
        _error(f"error: {exc}")
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except SystemExit as exc:  # a command's documented exit code (1 check failed, 3 CI)
        if type(sys.stdout).__name__ == "_PacifyFlushWrapper":   # click met EPIPE on stdout
            return _stdout_closed()
        return exc.code if isinstance(exc.code, int) else errors.EXIT_INTERNAL
    except click.ClickException as exc:
        _error(f"error: {exc.format_message()} (see --help)")
        return errors.EXIT_BAD_INPUT
    except (click.Abort, KeyboardInterrupt):
        _error("interrupted; nothing half-written was left behind")
        return 130
    except BrokenPipeError:
        return _stdout_closed()
    except OSError as exc:     # the environment refused (a path, a file system): not a defect
        where = f" {exc.filename}" if exc.filename else ""
        _error(f"error: cannot use{where}: {exc.strerror or exc}; check the path and the file "
               "system")
        return errors.EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001 - last resort: one line, exit 4
        if os.environ.get("FUSECLI_DEBUG"):
            raise
        _error(f"internal error: {type(exc).__name__}: {exc} (set FUSECLI_DEBUG=1 for a "
               "traceback and report it)")
        return errors.EXIT_INTERNAL


def _stdout_closed() -> int:
    _error("error: standard output is closed (or its reader went away); run fusecli with "
           "stdout open, e.g. redirected to a file")
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - nothing more may fail at exit
    return errors.EXIT_BAD_INPUT
