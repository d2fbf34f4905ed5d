"""`jzero` command line: train, layout, hlo, memory, ckpt (info, import-/export-megatron), data.

JAX is imported only after the config is read, so `train.host_devices` can set the
number of simulated CPU devices before the backend starts.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

from jzero import peers
from jzero.config import Config, ConfigError, load_config
from jzero.errors import CheckpointError, JzeroError, Preempted
from jzero.imports import quiet_cuda_stub
from jzero.paths import refuse_other_runs_files, refuse_unwritable
from jzero.zero.config import ZeroPath


def _start(cfg: Config, args: argparse.Namespace | None = None) -> None:
    """Starts JAX for `cfg` (and joins a multi-process run if `args` asks)."""
    from jzero.config import to_dict
    from jzero.runtime import start_jax

    multi = _multiprocess(args) if args is not None else {}
    start_jax(cfg.train.host_devices, timeouts=cfg.distributed, config=to_dict(cfg) if multi else None, **multi)


def _multiprocess(args: argparse.Namespace) -> dict:
    """`jzero train`'s multi-process flags, checked, as `start_jax` arguments ({}: one process)."""
    flags = {"--coordinator": args.coordinator, "--num-processes": args.num_processes, "--process-id": args.process_id}
    given = [flag for flag, value in flags.items() if value is not None]
    if args.distributed:
        if given:
            raise ConfigError(f"--distributed takes the run's layout from the cluster: drop {given[0]}")
        return {"distributed": True}
    if not given:
        return {}
    if len(given) < 3:
        missing = " and ".join(flag for flag in flags if flag not in given)
        raise ConfigError(
            f"{' and '.join(given)} without {missing}: a multi-process run by hand needs all three "
            "(or --distributed on a cluster, or `jzero launch --local N` on this machine)"
        )
    n, me = args.num_processes, args.process_id
    if n < 1:
        raise ConfigError(f"--num-processes {n} must be >= 1")
    if not 0 <= me < n:
        raise ConfigError(f"--process-id {me} must be in [0, --num-processes) = [0, {n})")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--coordinator {args.coordinator} must be HOST:PORT, e.g. 10.0.0.1:12355")
    return {"coordinator": args.coordinator, "num_processes": n, "process_id": me}


def _cmd_train(args) -> int:
    from jzero.train.preemption import Preemption

    with Preemption() as preemption:  # from the start: a SIGTERM in any phase ends the run (docs/operations.md)
        return _train_command(args, preemption)


def _claim_run_dir(root: Path = Path("runs"), tries: int = 100) -> Path:
    """Creates and returns a new directory `root/<YYYYmmdd-HHMMSS>` for a run given no --out.

    Claimed with an exclusive `os.mkdir`, so two runs started in the same second never share one
    (nor its metrics.jsonl): a name that exists already, as a directory or a file, is skipped for
    `<timestamp>-1`, `-2`, ... up to `tries` names; then one ConfigError line. Creates `root`
    (with its parents) if missing; starts no JAX.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        root.mkdir(parents=True, exist_ok=True)
        for i in range(tries):
            out = root / (f"{stamp}-{i}" if i else stamp)
            try:
                os.mkdir(out)
                return out
            except FileExistsError:
                continue
    except OSError as e:
        raise ConfigError(f"output directory {root / stamp}: cannot create it: {e.strerror or e}") from None
    raise ConfigError(
        f"output directory {root / stamp}: it and {stamp}-1 .. -{tries - 1} all exist already; choose --out"
    )


def check_train_args(args) -> tuple[Config, Path]:
    """`jzero train`'s input checked before JAX starts, creating nothing: (the config, the output directory,
    or for no --out the `runs` directory a new run directory goes in). `jzero launch` checks its processes'
    arguments with it once, so a bad input is one line, not one per process. Raises ConfigError."""
    cfg = load_config(args.config, args.set)
    if args.resume_fallback and args.resume is None:
        raise ConfigError("--resume-fallback only applies with --resume")
    # No --out: a new runs/<timestamp>, claimed below once the input is checked (`_claim_run_dir`).
    out = Path(args.out) if args.out else Path("runs")
    # Before JAX starts, and creating nothing: could `train` make `out` and write in it?
    name = f"--out {out}" if args.out else f"output directory {out}/<timestamp>"
    refuse_unwritable(out, name, out_is_named=bool(args.out))
    if args.out and args.resume is None:  # --out is owned as checkpoint.dir is: only --resume continues its files
        refuse_other_runs_files(out, name)
    return cfg, out


def _train_command(args, preemption) -> int:
    cfg, out = check_train_args(args)
    claimed = None  # the run directory this run made (no --out), removed again if the run fails before writing
    if not args.out:
        _multiprocess(args)  # its flags checked before anything is created (`_start` checks them again)
        # Only process 0 writes in `out`: it claims one. With --distributed its number is known once JAX joins.
        claimed = _claim_run_dir(out) if args.process_id in (None, 0) and not args.distributed else None
        out = claimed or out / time.strftime("%Y%m%d-%H%M%S")
    try:
        _start(cfg, args)
        preemption.reinstall()  # a multi-process join installs JAX's own SIGTERM handler
        if not args.out and args.distributed:
            import jax

            claimed = _claim_run_dir(out.parent) if jax.process_index() == 0 else None
            out = claimed or out
        from jzero.train import report
        from jzero.train.loop import train

        summary = train(
            cfg, out, progress=not args.quiet, resume=args.resume, resume_fallback=args.resume_fallback,
            preemption=preemption,
        )
    except BaseException:
        if claimed is not None:
            with contextlib.suppress(OSError):  # still empty: nothing of the run's in it
                claimed.rmdir()
        raise
    if summary is None or not summary:  # nothing left to train, or not process 0
        return 0
    print(report.format_summary(summary))
    print(f"metrics: {out / 'metrics.jsonl'}  summary: {out / 'summary.json'}")
    return 0


def _cmd_ckpt_info(args) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with quiet_cuda_stub():
        from jzero.train.ckpt_info import describe, verify_steps

    try:
        print(describe(args.dir))
    except CheckpointError:
        if not args.verify:  # --verify goes on to name every damaged step
            raise
    if args.verify:
        problems = verify_steps(args.dir)
        for step, problem in problems.items():
            print(f"step {step}: {'DAMAGED: ' + problem if problem else 'verified'}")
        damaged = [str(step) for step, problem in problems.items() if problem]
        if damaged:
            raise CheckpointError(f"damaged checkpoint steps in {args.dir}: {', '.join(damaged)}")
    return 0


def _cmd_data_prepare(args) -> int:
    from jzero.train.prepare import prepare

    r = prepare(args.src, args.out_prefix, args.tokenizer)
    print(
        f"wrote {r['documents']} documents, {r['tokens']} tokens ({r['dtype']}, vocabulary {r['vocab_size']}) "
        f"to {r['prefix']}.bin + {r['prefix']}.idx\n"
        f"train on it: jzero train --set data.kind=indexed --set data.path={r['prefix']} "
        f"--set model.vocab_size={r['vocab_size']}"
    )
    return 0


def _cmd_layout(args) -> int:
    import dataclasses
    import json

    from jzero.inspect.layout import check_config_rank, check_rank  # imports no JAX

    cfg = load_config(args.config, args.set)
    check_config_rank(args.rank, cfg)  # before JAX starts, where the mesh sizes say
    if cfg.zero.path == ZeroPath.OWNED:  # whole-tensor ownership: which rank owns which param (or layer)
        return _owned_layout(cfg, args)
    cfg = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, path=ZeroPath.FLAT))  # the flat path's layout
    _start(cfg)
    from jzero.inspect.layout import describe, format_layout
    from jzero.run import build_run

    d = describe(build_run(cfg).zero.flat)
    check_rank(args.rank, d["buffer"]["dp_size"])
    print(json.dumps(d, indent=1) if args.json else format_layout(d, args.rank))
    return 0


def _owned_layout(cfg, args) -> int:
    import json

    from jzero.inspect.layout import check_rank

    _start(cfg)
    import jax

    from jzero.run import build_run
    from jzero.zero.owned.plan import describe as describe_owned

    zero = build_run(cfg).zero
    owned, names = zero.layout.owned, [t.name for t in jax.tree.leaves(zero.plan.tensors)]
    check_rank(args.rank, owned.domains[0].d)  # the dense domain's ranks
    if args.json:
        doms = [{"axes": list(d.axes), "segment": d.size, "owners": [
            [{"param": names[p.leaf], "layer": p.layer, "offset": p.offset, "numel": p.numel} for p in d.owned(r)]
            for r in range(d.d)]} for d in owned.domains]  # fmt: skip
        print(json.dumps({"balance": owned.balance.value, "domains": doms}, indent=1))
    else:
        print("\n".join(describe_owned(owned, names)))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser, and its subcommands' (`add_subparsers` makes them of this class), whose errors are one
    line, as jzero's others are, naming where the usage is instead of printing it."""

    def error(self, message: str):
        self.exit(2, f"jzero: error: {message} (usage: {self.prog} -h)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="jzero", description="ZeRO-1/2/3 for JAX, Megatron-exact.")
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp):
        sp.add_argument(
            "config", nargs="?", help="YAML config, or a preset's name: llama2_7b, ... (default: the embedded tiny GPT)"
        )
        sp.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. zero.strategy=optim"
        )

    t = sub.add_parser("train", help="train a GPT (or the model.impl model) with a ZeRO strategy")
    with_config(t)
    t.add_argument("--out", help="output directory (default: a new runs/<timestamp>, or <timestamp>-1, ... if taken)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument(
        "--resume", nargs="?", const="", metavar="DIR",
        help="continue from the newest complete checkpoint in DIR (default: checkpoint.dir), on this config's mesh",
    )
    t.add_argument(
        "--resume-fallback", action="store_true", help="if the newest checkpoint is unreadable, use the previous one"
    )
    dist = t.add_argument_group(
        "multi-process (docs/cluster.md; host_devices = devices per process; bounds: distributed.*)"
    )
    dist.add_argument(
        "--distributed", action="store_true",
        help="take the coordinator, process count and id from the cluster (SLURM, Open MPI, Kubernetes)",
    )
    dist.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address, the same for every process")
    dist.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    dist.add_argument("--process-id", type=int, metavar="I", help="this process, 0 .. N-1 (0 hosts the coordinator)")
    t.set_defaults(fn=_cmd_train)

    from jzero.launch import add_parser as add_launch  # jzero launch --local N (imports no JAX)

    add_launch(sub, t, check_train_args)

    ck = sub.add_parser("ckpt", help="inspect checkpoints; move them to and from Megatron")
    ck_sub = ck.add_subparsers(dest="ckpt_command", required=True)
    info = ck_sub.add_parser("info", help="steps, the writer's strategy/mesh/dtypes, per-array shapes")
    info.add_argument("dir")
    info.add_argument("--verify", action="store_true", help="read every array and check it against its fingerprint")
    info.set_defaults(fn=_cmd_ckpt_info)
    from jzero.interop.commands import add_parsers as add_megatron  # import-/export-megatron (imports no JAX)

    add_megatron(ck_sub, with_config)

    data = sub.add_parser("data", help="training data")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser(
        "prepare", help="text files -> Megatron's indexed dataset (OUT_PREFIX.bin/.idx), as preprocess_data.py writes"
    )
    prep.add_argument("src", metavar="SRC_DIR", help="directory of *.py, *.txt, *.md files: one document each")
    prep.add_argument("out_prefix", metavar="OUT_PREFIX", help="writes OUT_PREFIX.bin and OUT_PREFIX.idx")
    prep.add_argument(
        "--tokenizer", metavar="TOKENIZER_JSON",
        help="a Hugging Face tokenizers file (pip install 'jzero[data]'); default: byte tokens, vocabulary 256",
    )  # fmt: skip
    prep.set_defaults(fn=_cmd_data_prepare)

    lay = sub.add_parser(
        "layout", help="Megatron's flat buffers: buckets, padding, which rank owns what (zero.path=owned: whole params)"
    )
    with_config(lay)
    lay.add_argument(
        "--rank",
        type=int,
        default=0,
        help="dense data-parallel rank to show (default 0); the expert buffer shows that device's expert-DP rank",
    )
    lay.add_argument("--json", action="store_true", help="the whole layout, every rank, as JSON")
    lay.set_defaults(fn=_cmd_layout)

    from jzero.inspect.commands import add_parsers  # jzero hlo, jzero memory (imports no JAX)

    add_parsers(sub, with_config)
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns its exit code (2 for any error reported in one line)."""
    args = _parser().parse_args(argv)
    # orbax logs every failure with a traceback (absl), and its abandoned async writes as "Task exception was
    # never retrieved" (asyncio): jzero reports the failure itself, in one line.
    for library in ("absl", "asyncio"):
        logging.getLogger(library).setLevel(logging.CRITICAL)
    try:
        return args.fn(args)
    except JzeroError as e:
        _say(f"jzero: {'stopped' if isinstance(e, Preempted) else 'error'}: {e}")
        return getattr(e, "exit_code", 2)
    except OSError as e:  # a file, directory or disk the run was given (ENOSPC, EACCES, ...)
        where = f"{e.filename}: " if e.filename else ""
        _say(f"jzero: error: {where}{e.strerror or e}")
        return 2
    except KeyboardInterrupt:
        _say("jzero: interrupted")
        return 130


def _say(line: str) -> None:
    """One write per line, so `jzero launch` never interleaves another process's output into it."""
    sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def console() -> None:
    """The `jzero` executable: `main`, then an exit that no library thread can hold up.

    After a failure (already reported in one line) a failed async save or a lost peer can leave
    non-daemon threads (orbax's, JAX's) that the interpreter would wait for forever at exit, so
    the process leaves at once. Otherwise a process of a multi-process run leaves it first (JAX's
    shutdown included; `jzero.peers.finish`), then exits normally.
    """
    code = main()
    stuck = any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread())
    if code != 0 and stuck:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    peers.finish(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
