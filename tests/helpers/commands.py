"""`jzero hlo` and `jzero memory` run in-process, as `jzero.cli.main` runs them, on a 1-layer GPT."""

import argparse
import sys

import pytest

from jzero.config import ConfigError
from jzero.inspect.commands import add_parsers
from jzero.inspect.targets import cuda_plugin_available

# A 1-layer GPT (vocab 256, every dim divisible by 8, so every tensor is sharded over dp=8).
TINY = ["model.n_layers=1", "model.seq_len=16", "model.d_model=32", "model.d_ff=64", "data.kind=synthetic"]
needs_cuda = pytest.mark.skipif(
    not cuda_plugin_available(), reason="CUDA PJRT plugin not installed: pip install -e .[gpu-aot]"
)


def jzero(argv: list[str], overrides=TINY) -> int:
    """The subcommands as `jzero.cli.main` runs them (exit 2 and one line on a ConfigError)."""

    def with_config(sp):
        sp.add_argument("config", nargs="?")
        sp.add_argument("--set", action="append", default=[])

    parser = argparse.ArgumentParser(prog="jzero")
    add_parsers(parser.add_subparsers(dest="command", required=True), with_config)
    for o in overrides:
        argv = [*argv, "--set", o]
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"jzero: error: {e}", file=sys.stderr)
        return 2
