"""`jzero hlo` and `jzero memory`: compile the train step once per ZeRO strategy, run nothing, and
report its collectives (`comms`) or its bytes per device (`memory`), for the local CPU devices
or a GPU pod compiled deviceless (`--target h100 --topology "4 x 1 x 8"`).

Registered by `jzero.cli` through `add_parsers`; like every command, a handler reads the config
first and imports JAX only after `jzero.runtime.start_jax` (which sets the simulated device count).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from jzero.config import Config, ConfigError, load_config
from jzero.paths import nearest_existing
from jzero.zero.config import ShardingStrategy, ZeroPath

# The keys of `targets.TARGETS` (not imported here: it imports JAX, which must start later).
TARGET_CHOICES = ("cpu", "h100", "a100", "h200")
# Every zero.strategy, on either path.
DEFAULT_STRATEGIES = "no_shard,optim,optim_grads,optim_grads_params"


def add_parsers(subparsers, with_config) -> None:
    """Adds `hlo` and `memory` to the `jzero` subcommands; `with_config(sp)` adds CONFIG and --set."""
    h = subparsers.add_parser("hlo", help="compiled collectives of each ZeRO stage: count, bytes, axes, vs theory")
    with_config(h)
    _common(h)
    for flag, what in (
        ("--nvlink-gbs", "GB/s per direction between GPUs of a host"),
        ("--network-gbs", "GB/s per direction per GPU between hosts"),
        ("--peak-tflops", "dense bf16 TFLOP/s per GPU"),
    ):
        h.add_argument(flag, type=_positive, metavar="X", help=f"{what} for the time estimate (default: the target's)")
    h.set_defaults(fn=cmd_hlo)

    m = subparsers.add_parser("memory", help="per-device bytes of each ZeRO stage (compiled and formula), fits?")
    with_config(m)
    _common(m)
    m.set_defaults(fn=cmd_memory)


def _common(sp) -> None:
    sp.add_argument(
        "--strategies",
        help=f"comma-separated zero.strategy values (default {DEFAULT_STRATEGIES}; with zero.param_gather_dtype "
        "or zero.path=owned optim,optim_grads)",
    )
    sp.add_argument("--path", choices=("spec", "flat", "owned"), help="zero.path (default: the config's)")
    sp.add_argument(
        "--target", choices=TARGET_CHOICES, default="cpu", help="compile for (default: the local cpu devices)"
    )
    sp.add_argument(
        "--topology",
        metavar='"S x H x D"',
        help='GPU pod: slices x hosts per slice x GPUs per host, e.g. "4 x 1 x 8" = 32 GPUs '
        "(default: hosts of 8 GPUs holding the mesh, one host with mesh.dp=-1); its product must equal the mesh size",
    )
    sp.add_argument("--json", metavar="FILE", help="also write the report as JSON (schema: docs/inspect.md)")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _strategies(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    known = [s.value for s in ShardingStrategy]
    for s in names:
        if s not in known:
            raise ConfigError(f"--strategies: {s!r} is not one of: {', '.join(known)}")
    if not names:
        raise ConfigError("--strategies is empty")
    return list(dict.fromkeys(names))


def _compile_all(cfg: Config, args, dump: bool) -> dict:
    """{strategy: CompiledStep} for every strategy of `--strategies`; `dump` keeps XLA's dump (the peak)."""
    from jzero.inspect.compile import compile_step, with_zero

    out = {}
    default = DEFAULT_STRATEGIES
    if cfg.zero.param_gather_dtype is not None or cfg.zero.path == ZeroPath.OWNED:  # ZeRO-1/2 only: a quantized
        default = "optim,optim_grads"  # gather follows the step; the owned path keeps the params whole
    for s in _strategies(default if args.strategies is None else args.strategies):
        out[s] = compile_step(with_zero(cfg, s, args.path), args.target, args.topology, dump=dump)
        print(f"compiled {s} in {out[s].compile_s:.1f} s", file=sys.stderr, flush=True)
    return out


def _write_json(path: str | None, doc: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)


def _check_json(path: str | None) -> None:
    """Before anything compiles: --json names a new file in a directory jzero can make or write in."""
    if not path:
        return
    out = Path(path)
    if out.exists() or out.is_symlink():
        raise ConfigError(f"--json {out} exists: jzero never replaces a file it did not write; name a new file")
    existing, what = nearest_existing(out.parent)
    if what is not None:
        raise ConfigError(f"--json {out}: {existing} is {what}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--json {out}: directory {existing} is not writable")


def _check_topology(topology: str | None) -> None:
    """Before JAX starts: --topology is three positive integers of at most `targets.MAX_TOPOLOGY_GPUS` GPUs
    (a larger one fails deep in XLA, or takes minutes making devices). `compile.target_devices` checks it fits."""
    if topology is None:
        return
    from jzero.inspect.targets import parse_topology  # imports no JAX

    try:
        parse_topology(topology)
    except ValueError as e:
        raise ConfigError(f"--topology: {e}") from None


def _report(args, module_name: str) -> int:
    """Compiles every strategy, prints the `comms` or `memory` report, writes --json."""
    # --path before validation: a key that needs the flat path (zero.param_gather_dtype) may come with it.
    cfg = load_config(args.config, [*args.set, *([f"zero.path={args.path}"] if args.path else [])])
    _check_json(args.json)
    _check_topology(args.topology)
    from jzero.runtime import start_jax

    start_jax(cfg.train.host_devices)
    import importlib

    module = importlib.import_module(f"jzero.inspect.{module_name}")
    compiled = _compile_all(cfg, args, dump=module_name == "comms")  # jzero hlo reads the peak
    if module_name == "comms":
        from jzero.inspect.timing import Overrides

        doc = module.report(compiled, Overrides(args.nvlink_gbs, args.network_gbs, args.peak_tflops))
    else:
        doc = module.report(compiled)
    print(module.format_report(doc))
    _write_json(args.json, doc)
    return 0


def cmd_hlo(args) -> int:
    return _report(args, "comms")


def cmd_memory(args) -> int:
    return _report(args, "memory")
