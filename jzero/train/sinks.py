"""Where a run's metrics go, from process 0: `metrics.jsonl`, and on request TensorBoard event files
(`train.tensorboard_dir`, Megatron's --tensorboard-dir) and a Weights & Biases run (`train.wandb_project`,
Megatron's --wandb-project), each with the same scalars under metrics.jsonl's names, at its `step`.

metrics.jsonl is strict JSON (RFC 8259, read by jq, pandas, any parser): a value that is not a finite
number (a NaN grad norm, an inf loss) is written as null, and the row's `nonfinite` names it and its kind,
`{"grad_norm": null, ..., "nonfinite": {"grad_norm": "nan"}}` ("nan", "inf" or "-inf"); `read_metrics`
gives the floats back. summary.json is written the same way (`dumps`). TensorBoard and W&B get the float
itself, NaN or inf, which both plot; a null (an fp16 step's grad norm, skipped) is left out of them.

TensorBoard events are written without TensorFlow (`tensorboard.summary.writer`, scalars as
`simple_value`: float32, as torch's SummaryWriter writes Megatron's). A run marks its first step with a
SessionLog START, so a resumed run's events replace the orphaned ones after its checkpoint in
TensorBoard's reader. W&B gets the config (`jzero.config.to_dict`) as the run's config; a resumed
run is a new W&B run whose steps go on from the checkpoint's.

The optional packages are imported only when their key is set: `check` (on process 0, before the run
is built) stops a run whose package is missing or whose directory cannot be written with one
ConfigError line.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from jzero.config import Config, to_dict
from jzero.errors import ConfigError, one_line
from jzero.paths import nearest_existing

NONFINITE = "nonfinite"  # the row's key naming its values written as null: {key: "nan" | "inf" | "-inf"}
_KINDS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


# ---- strict JSON -------------------------------------------------------------------------------------------


def _is_float(v) -> bool:
    return isinstance(v, float | np.floating)


def _kind(v: float) -> str:
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _strict(obj):
    """`obj` with every non-finite float (at any depth) as None."""
    if _is_float(obj):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_strict(v) for v in obj]
    return obj


def dumps(obj, **kwargs) -> str:
    """`json.dumps` of `obj` as strict JSON: non-finite floats as null (summary.json)."""
    return json.dumps(_strict(obj), allow_nan=False, **kwargs)


def json_line(row: dict) -> str:
    """One metrics.jsonl row, strict JSON: a non-finite value null, named with its kind in `nonfinite`."""
    bad = {k: _kind(v) for k, v in row.items() if _is_float(v) and not math.isfinite(v)}
    out = {k: None if k in bad else _strict(v) for k, v in row.items() if k != NONFINITE}
    if bad or NONFINITE in row:
        out[NONFINITE] = {**row.get(NONFINITE, {}), **bad}
    return json.dumps(out, allow_nan=False) + "\n"


def read_metrics(path: str | Path) -> list[dict]:
    """metrics.jsonl's rows, the values its `nonfinite` names as floats again (NaN, inf); a line cut short
    (a killed run's last) is skipped."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            row.update({k: _KINDS[kind] for k, kind in row.pop(NONFINITE, {}).items()})
            rows.append(row)
    return rows


def _scalars(row: dict) -> dict[str, float]:
    """The row's numbers for TensorBoard and W&B: every value but `step`, non-finite ones included."""
    return {
        k: float(v)
        for k, v in row.items()
        if k not in ("step", NONFINITE) and isinstance(v, int | float | np.number) and not isinstance(v, bool)
    }


# ---- the checks before the run -----------------------------------------------------------------------------


def _writable_dir(key: str, value: str) -> None:
    """ConfigError unless `value` is, or can be made, a directory this process writes into."""
    path = Path(value).expanduser()
    existing, what = nearest_existing(path)
    if what is not None:
        where = "" if existing == path else f": {existing}"
        raise ConfigError(f"train.{key}={value!r}{where} is {what}: give a directory (it is created if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"train.{key}={value!r}: directory {existing} is not writable")


def _import(key: str, value: str, extra: str, module: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"train.{key}={value!r} needs the {extra} package ({one_line(e)}): pip install 'jzero[{extra}]'"
        ) from None


def _event_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*tfevents*")) if directory.is_dir() else []


def check(cfg: Config, fresh: bool = True) -> None:
    """ConfigError (one line naming the key and the fix) if a sink the config asks for cannot run here:
    its package is not installed, its directory is a file or not writable, or (`fresh`: not --resume)
    `train.tensorboard_dir` holds another run's event files. Called on process 0 before the run is built."""
    t = cfg.train
    if t.tensorboard_dir is not None:
        _writable_dir("tensorboard_dir", t.tensorboard_dir)
        _import("tensorboard_dir", t.tensorboard_dir, "tensorboard", "tensorboard.summary.writer.event_file_writer")
        if fresh and _event_files(Path(t.tensorboard_dir).expanduser()):
            raise ConfigError(
                f"train.tensorboard_dir={t.tensorboard_dir!r} holds another run's TensorBoard event files: a fresh "
                "run never mixes with them; choose a new directory, or continue that run with --resume"
            )
    if t.wandb_project is not None:
        if t.wandb_save_dir is not None:
            _writable_dir("wandb_save_dir", t.wandb_save_dir)
        _import("wandb_project", t.wandb_project, "wandb", "wandb")


# ---- the sinks ---------------------------------------------------------------------------------------------


class _TensorBoard:
    """Scalars as TensorBoard events in `directory`, without TensorFlow."""

    def __init__(self, directory: str, start: int):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2, summary_pb2
        try:
            self._writer = EventFileWriter(str(Path(directory).expanduser()), max_queue_size=1000, flush_secs=10)
        except OSError as e:
            raise ConfigError(f"train.tensorboard_dir={directory!r}: cannot write event files there ({e})") from None
        # TensorBoard's reader drops the events at and after a START's step seen before it: a resumed run's
        # steps replace those its previous attempt wrote after the checkpoint.
        start_log = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._writer.add_event(event_pb2.Event(step=start + 1, wall_time=time.time(), session_log=start_log))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        values = [self._summary.Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        summary = self._summary.Summary(value=values)
        self._writer.add_event(self._event.Event(step=step, wall_time=time.time(), summary=summary))

    def close(self, ok: bool) -> None:
        self._writer.close()  # flushes


class _WandB:
    """Scalars as a W&B run's history, at metrics.jsonl's steps."""

    def __init__(self, cfg: Config, out_dir: Path):
        import wandb

        t = cfg.train
        save_dir = t.wandb_save_dir or (None if os.environ.get("WANDB_DIR") else str(out_dir))
        try:
            if save_dir is not None:
                Path(save_dir).expanduser().mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"train.wandb_save_dir={save_dir!r}: cannot create it ({e})") from None
        try:
            self._run = wandb.init(
                project=t.wandb_project,
                name=t.wandb_exp_name or out_dir.resolve().name,
                dir=None if save_dir is None else str(Path(save_dir).expanduser()),
                config=to_dict(cfg),
            )
        except Exception as e:  # no login in online mode, a service that did not start: wandb's many types
            raise ConfigError(
                f"train.wandb_project={t.wandb_project!r}: wandb.init failed ({one_line(e)}); "
                "log in (wandb login, or WANDB_API_KEY) or set WANDB_MODE=offline"
            ) from None

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self, ok: bool) -> None:
        self._run.finish(exit_code=0 if ok else 1)


class Sinks:
    """metrics.jsonl and the sinks the config asks for; `write(row)` appends a step's row to each.
    A context manager: leaving it flushes and closes them all, on an error too."""

    def __init__(self, cfg: Config, out_dir: Path | None, start: int):
        self._file = None
        self._others: list = []
        try:  # the optional sinks first: one that fails leaves no metrics.jsonl behind
            if out_dir is not None and cfg.train.tensorboard_dir is not None:
                self._others.append(_TensorBoard(cfg.train.tensorboard_dir, start))
            if out_dir is not None and cfg.train.wandb_project is not None:
                self._others.append(_WandB(cfg, out_dir))
            self._file = _metrics_file(out_dir, start)
        except BaseException:
            self.close(ok=False)
            raise

    def write(self, row: dict) -> None:
        try:
            self._file.write(json_line(row))
            self._file.flush()
        except OSError as e:  # a write's error names no file: name metrics.jsonl (a full disk, ...)
            raise OSError(e.errno, e.strerror, self._file.name) from None
        if self._others:
            scalars = _scalars(row)
            for sink in self._others:
                sink.write(row["step"], scalars)

    def close(self, ok: bool = True) -> None:
        """Closes metrics.jsonl, then TensorBoard's file (quick), then W&B (whose upload may take longer). A sink
        that fails to close is named on stderr: the run's outcome is the steps', not the sink's."""
        failure = None
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()  # flushes what a failed write left in its buffer: it fails the same way
            except OSError as e:
                failure = OSError(e.errno, e.strerror, file.name)
        for sink in self._others:
            try:
                sink.close(ok)
            except Exception as e:
                name = type(sink).__name__.strip("_")
                print(f"jzero: warning: closing {name} failed: {one_line(e)}", file=sys.stderr, flush=True)
        self._others = []
        if failure is not None and ok:  # else the error that ended the run names it already
            raise failure

    def __enter__(self) -> Sinks:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)


def write_summary(path: Path, summary: dict) -> None:
    """summary.json, strict JSON (`dumps`); a failed write names the file (a full disk, ...)."""
    try:
        path.write_text(dumps(summary, indent=2))
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None


def open_sinks(cfg: Config, out_dir: Path | None, start: int) -> Sinks:
    """The run's sinks from step `start` (out_dir None: none, on processes other than 0)."""
    return Sinks(cfg, out_dir, start)


def _metrics_file(out_dir: Path | None, start: int):
    """metrics.jsonl to append to: a resumed run keeps the rows up to its start step (as strict JSON,
    whatever an older jzero wrote)."""
    if out_dir is None:
        return open(os.devnull, "w")
    path = out_dir / "metrics.jsonl"
    if start == 0 or not path.exists():
        return open(path, "w")
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            if row["step"] <= start:
                kept.append(json_line(row))
        except (ValueError, KeyError, TypeError):
            continue  # a row cut short by a kill or a full disk
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return open(path, "a")
