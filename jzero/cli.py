"""`jzero` command line: train, layout, hlo, memory, ckpt.

JAX is imported only after the config is read, so `train.host_devices` can set the
number of simulated CPU devices before the backend starts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from jzero.config import Config, ConfigError, ZeroPath, load_config
from jzero.errors import JzeroError


def _start(cfg: Config, args: argparse.Namespace | None = None) -> None:
    """Starts JAX for `cfg` (and joins a multi-process run if `args` asks)."""
    from jzero.runtime import start_jax

    dist = {}
    if args is not None and getattr(args, "coordinator", None):
        dist = dict(coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
    start_jax(cfg.train.host_devices, distributed=bool(getattr(args, "distributed", False)), **dist)


def _cmd_train(args) -> int:
    cfg = load_config(args.config, args.set)
    if args.coordinator and (args.num_processes is None or args.process_id is None):
        raise ConfigError("--coordinator needs --num-processes and --process-id")
    _start(cfg, args)
    from jzero.train import report
    from jzero.train.loop import train

    out = Path(args.out) if args.out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    summary = train(cfg, out, progress=not args.quiet, resume=args.resume, resume_fallback=args.resume_fallback)
    if summary is None or not summary:  # nothing left to train, or not process 0
        return 0
    print(report.format_summary(summary))
    print(f"metrics: {out / 'metrics.jsonl'}  summary: {out / 'summary.json'}")
    return 0


def _cmd_ckpt_info(args) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jzero.train.checkpoint import describe

    print(describe(args.dir))
    return 0


def _cmd_layout(args) -> int:
    import dataclasses
    import json

    cfg = load_config(args.config, args.set)
    cfg = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, path=ZeroPath.FLAT))  # the flat path's layout
    _start(cfg)
    from jzero.inspect.layout import describe, format_layout
    from jzero.train.loop import setup

    d = describe(setup(cfg, with_data=False).zero.flat)
    if not 0 <= args.rank < d["buffer"]["dp_size"]:
        raise ConfigError(f"--rank {args.rank} is outside the data-parallel group of size {d['buffer']['dp_size']}")
    print(json.dumps(d, indent=1) if args.json else format_layout(d, args.rank))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jzero", description="ZeRO-1/2/3 for JAX, Megatron-exact.")
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp):
        sp.add_argument("config", nargs="?", help="YAML config (default: the embedded tiny GPT)")
        sp.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. zero.strategy=optim"
        )

    t = sub.add_parser("train", help="train a GPT with a ZeRO strategy")
    with_config(t)
    t.add_argument("--out", help="output directory (default: runs/<timestamp>)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument(
        "--resume", nargs="?", const="", metavar="DIR",
        help="continue from the newest complete checkpoint in DIR (default: checkpoint.dir), on this config's mesh",
    )
    t.add_argument(
        "--resume-fallback", action="store_true", help="if the newest checkpoint is unreadable, use the previous one"
    )
    dist = t.add_argument_group("multi-process (one process per host; host_devices = devices per process)")
    dist.add_argument(
        "--distributed", action="store_true", help="jax.distributed.initialize() with cluster auto-detection"
    )
    dist.add_argument("--coordinator", metavar="HOST:PORT", help="coordinator address (process 0 listens there)")
    dist.add_argument("--num-processes", type=int)
    dist.add_argument("--process-id", type=int)
    t.set_defaults(fn=_cmd_train)

    ck = sub.add_parser("ckpt", help="inspect checkpoints")
    ck_sub = ck.add_subparsers(dest="ckpt_command", required=True)
    info = ck_sub.add_parser("info", help="steps, the writer's strategy/mesh/dtypes, per-array shapes")
    info.add_argument("dir")
    info.set_defaults(fn=_cmd_ckpt_info)

    lay = sub.add_parser("layout", help="Megatron's flat buffers: buckets, padding, which rank owns what")
    with_config(lay)
    lay.add_argument("--rank", type=int, default=0, help="data-parallel rank to show (default 0)")
    lay.add_argument("--json", action="store_true", help="the whole layout, every rank, as JSON")
    lay.set_defaults(fn=_cmd_layout)

    from jzero.inspect.commands import add_parsers  # jzero hlo, jzero memory (imports no JAX)

    add_parsers(sub, with_config)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.fn(args)
    except JzeroError as e:
        print(f"jzero: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file, directory or disk the run was given (ENOSPC, EACCES, ...)
        where = f" {e.filename}" if e.filename else ""
        print(f"jzero: error:{where}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jzero: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
