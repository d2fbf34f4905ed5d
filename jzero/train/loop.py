"""The training harness: a run (`jzero.run`) and its data -> steps, checkpoints, metrics, summary."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jzero import multihost, peers
from jzero.config import Config, ConfigError
from jzero.errors import Preempted, RunError
from jzero.optim import lr_schedule
from jzero.paths import refuse_other_runs_files
from jzero.run import Run, build_run
from jzero.train import ckpt_dir, sinks
from jzero.train.data import data_identity, make_datasets
from jzero.train.preemption import Preemption
from jzero.train.preflight import check_fits, check_floor, out_of_memory
from jzero.zero.common.state import TrainState


def setup(cfg: Config, devices: list | None = None, with_data: bool = True) -> Run:
    """`jzero.run.build_run` (mesh, the model `model.impl` names, ZeRO run; ConfigError on misfit) and
    the run's datasets, which every process must agree on.

    with_data=False skips the dataset (compile-only tools never read it).
    """
    run = build_run(cfg, devices)
    return with_datasets(run) if with_data else run


def with_datasets(run: Run) -> Run:
    """`run` with its training and validation data attached (`_datasets`)."""
    dataset, val_dataset = _datasets(run.cfg)
    return dataclasses.replace(run, dataset=dataset, val_dataset=val_dataset)


def _datasets(cfg: Config):
    """`make_datasets` on every process, which must agree: a file one process cannot read stops them
    all with its line (not only that one, leaving the others waiting in a collective), and processes
    that see different data (token counts or splits) stop with one line naming both."""
    datasets, failure = (None, None), None
    try:
        datasets = make_datasets(cfg)
    except ConfigError as e:
        failure = str(e)
    failure = multihost.first_failure(failure)
    if failure is not None:
        raise ConfigError(failure)
    multihost.same_everywhere(
        " ".join(_data_fact(d) for d in datasets), "data (a data.path not shared, or files of other lengths?)"
    )
    return datasets


def _data_fact(dataset) -> str:
    """What identifies a dataset across processes: its class, and for a token stream its length and
    region (no file is read whole for it)."""
    if dataset is None:
        return "-"
    tokens = getattr(dataset, "tokens", None)
    size = "" if tokens is None else f":{len(tokens)}:{dataset.lo}-{dataset.hi}"
    return type(dataset).__name__ + size


def train(
    cfg: Config,
    out_dir: Path,
    progress: bool = True,
    resume: str | None = None,
    resume_fallback: bool = False,
    preemption: Preemption | None = None,
) -> dict | None:
    """Trains up to `cfg.train.steps`; writes `out_dir/metrics.jsonl` and `summary.json`.

    Args:
      resume: None = start fresh; "" = resume from `checkpoint.dir`; else a checkpoint
        directory. Continues from its newest complete step (onto this config's mesh,
        strategy and path); checkpoints keep going to `checkpoint.dir` (default: there),
        and `metrics.jsonl` is continued, not rewritten. A `checkpoint.dir` with no step yet
        starts from step 0 (as Megatron's `--load`), so a job script can always pass --resume.
      resume_fallback: if the newest checkpoint is damaged, use the one before it (moving the damaged one to
        `damaged/` where the directory is this run's checkpoint.dir; one it only reads is left as it is).
      preemption: the SIGTERM watch the caller entered (the CLI, from its start); None = one for this call.
    Returns:
      the summary (see `report.summarize`), None if the checkpoint already reached the end,
      {} on processes other than 0 (only process 0 writes files and reports).
    Raises:
      ConfigError: without `resume`, `out_dir` holds another run's metrics.jsonl or summary.json.
      CheckpointError: checkpoint.dir is not this run's to write (see `jzero.train.ckpt_dir`),
        or the checkpoint to resume is damaged or does not fit.
      RunError: a save failed, or the loss is not finite. Preempted: SIGTERM stopped the run
        after a step, whose checkpoint was saved (with checkpoint.dir set). SIGTERM before the
        first step, or a step that does not end soon enough, ends the process (`jzero.train.preemption`).
    """
    if resume is None:  # as `jzero train --out` refuses: only a resume continues a run's files
        failure = None
        if jax.process_index() == 0:  # the one writer, asked before it writes (a collective: no process races it)
            try:
                refuse_other_runs_files(out_dir, f"out_dir {out_dir}", "choose another, or continue that run (resume=)")
            except ConfigError as e:
                failure = str(e)
        if (failure := multihost.first_failure(failure)) is not None:
            raise ConfigError(failure)
    watch = contextlib.nullcontext(preemption) if preemption is not None else Preemption()
    with watch as preemption:
        return _train(cfg, out_dir, progress, resume, resume_fallback, preemption)


def _train(cfg, out_dir, progress, resume, resume_fallback, preemption: Preemption) -> dict | None:
    from jzero.train import report
    from jzero.train.checkpoint import Checkpointer
    from jzero.train.resume import resolve_resume_dir, restore_latest

    multihost.on_process_0(lambda: sinks.check(cfg, fresh=resume is None), ConfigError)  # tensorboard, wandb
    check_floor(cfg, jax.devices())  # from the config alone: building a model of 20,000 blocks takes minutes
    run = build_run(cfg)
    check_fits(run)  # before any state is allocated or any step compiled
    run = with_datasets(run)
    cfg = run.cfg  # mesh.dp resolved
    ck = cfg.checkpoint
    main_process = jax.process_index() == 0
    resume_dir = None if resume is None else resolve_resume_dir(cfg, resume or None)
    multihost.same_everywhere(f"--resume reads {resume_dir}", "checkpoint directories (a path not shared?)")
    save_dir = ckpt_dir.resolved(ck.dir) if ck.dir is not None else resume_dir
    continuing = resume_dir is not None and save_dir == resume_dir
    ckpt = None
    if save_dir is not None:
        ckpt = Checkpointer(
            save_dir, run, keep=ck.keep, async_save=ck.async_, resume=continuing, timeout_s=ck.timeout_s
        )
    if resume is not None and resume_dir is None and main_process:  # once the directory is this run's to write
        print(f"no checkpoint in checkpoint.dir={ck.dir} yet: starting from step 0")
    failed = True
    try:
        if resume_dir is None:
            state, start = run.init_state(), 0
        else:
            preemption.phase = "restore"
            reader = ckpt if continuing else Checkpointer(resume_dir, run, writer=False)
            state, start = restore_latest(reader, resume_fallback, say=_tell)
            saved_data = reader.meta(start)["data"]  # every process: orbax reads in step with the others
            if main_process:
                print(f"resuming from checkpoint step {start} in {resume_dir}")
                _warn_if_other_data(saved_data, cfg)
        if start >= cfg.train.steps:
            print(f"checkpoint step {start} already reached train.steps={cfg.train.steps}: nothing to do")
            failed = False
            return None
        if main_process:
            out_dir.mkdir(parents=True, exist_ok=True)
        metrics_dir = out_dir if main_process else None
        (metrics, state), compile_s = _loop(run, state, start, metrics_dir, ckpt, progress, preemption)
        failed = False
    except Exception as e:  # the pre-flight's floor fit, yet the device ran out: one line, the same advice
        if (oom := out_of_memory(e, preemption.phase)) is not None:
            raise oom from None
        raise
    finally:
        if ckpt is not None:
            ckpt.close(check=not failed)  # waits for the save in flight; reports its failure
    summary = report.summarize(run, state, metrics, compile_s)
    if main_process:
        sinks.write_summary(out_dir / "summary.json", summary)
    if preemption.stopped_at is not None:
        saved = f"checkpoint step {preemption.stopped_at} is in {ckpt.directory}" if ckpt else "no checkpoint.dir"
        raise Preempted(f"SIGTERM: stopped after step {preemption.stopped_at}; {saved}")
    return summary if main_process else {}


def _loop(run: Run, state: TrainState, start: int, out_dir: Path | None, ckpt, progress: bool, preemption):
    """Steps `start` .. `train.steps`; returns ((metrics, final state), compile seconds).

    out_dir None: write no metrics file (processes other than 0). A SIGTERM (`preemption`)
    ends the loop after the step it arrives in, with that step saved.
    """
    cfg = run.cfg
    preemption.phase = "compile"
    peers.progress(start, "compile")
    if progress and out_dir is not None:
        print("compiling the train step", flush=True)  # minutes for a large model, before the first step
    t0 = time.perf_counter()
    step_fn = run.zero.step.lower(state, run.device_batch(start)).compile()  # compile outside the timings
    compile_s = time.perf_counter() - t0
    preemption.phase = "step"
    schedule = lr_schedule(cfg)
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    metrics = []
    val_loss = None  # the last validation loss, for the progress bar
    bar = _progress(cfg.train.steps, progress and out_dir is not None)
    bar.update(start)
    with sinks.open_sinks(cfg, out_dir, start) as f:
        for step in range(start, cfg.train.steps):
            peers.progress(step, "step")
            batch = run.device_batch(step)
            t = time.perf_counter()
            state, m = step_fn(state, batch)
            m = jax.device_get(m)
            dt = time.perf_counter() - t
            peers.progress(step + 1, "step")
            skipped = bool(m.get("skipped", 0.0))  # an inf/nan grad norm or a spike skipped the update
            applied = step - _skipped_before(state, m)  # the optimizer steps before this one
            row = {
                "step": step + 1,
                "loss": float(m["loss"]),
                "grad_norm": float(m["grad_norm"]),  # inf or nan where the step was skipped: null, named in nonfinite
                "lr": float(schedule(applied)),
                "step_time_s": dt,
                "tokens_per_s": tokens_per_step / dt,
                # MoE: aux_loss, dropped_frac; fp16: loss_scale (the one this step's grads carried), skipped
                **{k: float(v) for k, v in m.items() if k not in ("loss", "grad_norm")},
            }
            # fp16's scaler skips inf/nan steps and goes on, the spike guard finite spikes
            nonfinite_grads = skipped and not m.get("spike_skipped") and state.opt_state.grad_scaler is None
            if nonfinite_grads or not np.isfinite(row["loss"]):
                f.write(row)
                raise RunError(_stop_line(row, m, ckpt, nonfinite_grads))
            stop = False
            if run.evaluates_at(step + 1):
                peers.progress(step + 1, "evaluate")
                # A SIGTERM before or during the evaluation ends it and saves the step (within GRACE_S).
                evaluated = run.evaluate(state.params, state.model_state, stop=preemption.requested)
                stop = evaluated is None
                if not stop:
                    row["val_loss"] = val_loss = evaluated["loss"]
            f.write(row)
            metrics.append(row)
            bar.update(1)
            if (step + 1) % cfg.train.log_every == 0 or step + 1 == cfg.train.steps:
                gnorm = "skipped" if skipped else f"{row['grad_norm']:.3f}"
                val = {} if val_loss is None else {"val": f"{val_loss:.4f}"}
                bar.set_postfix(loss=f"{row['loss']:.4f}", gnorm=gnorm, **_scale_postfix(row), **val)
            stop = stop or preemption.requested()
            due = (step + 1) % cfg.checkpoint.every == 0 or step + 1 == cfg.train.steps
            if ckpt is not None and (due or stop):
                peers.progress(step + 1, "save")
                ckpt.save(state, cfg)
            if stop:
                preemption.stopped_at = step + 1
                break
    bar.close()
    return (metrics, state), compile_s


def _stop_line(row: dict, m: dict, ckpt, nonfinite_grads: bool) -> str:
    """The one line a run stopped by an inf/nan ends with: the step, what was not finite, the newest checkpoint."""
    steps = ckpt.steps() if ckpt is not None else []
    newest = f"the newest checkpoint is step {steps[-1]}" if steps else "no checkpoint yet"
    if nonfinite_grads:  # train.check_for_nan_in_loss_and_grad
        norm = float(m["grad_norm"])
        return f"grad norm is {norm} at step {row['step']}: its update was skipped and the run stopped; {newest}"
    return f"loss is {row['loss']} at step {row['step']}: the run stopped; {newest}"


def _skipped_before(state: TrainState, m: dict) -> int:
    """Steps skipped before the one that produced `state` and its metrics `m`, steps whose optimizer step
    count (and learning rate) did not advance: fp16 loss scaling's and the spike guard's, each counted in
    its state (a nan-check skip stops the run)."""
    scaler, spike, spiked = state.opt_state.grad_scaler, state.opt_state.spike, bool(m.get("spike_skipped", 0.0))
    before = 0
    if scaler is not None:  # its skips are inf/nan ones, never a spike (`spike.is_spike`)
        before += int(scaler.skipped) - int(bool(m.get("skipped", 0.0)) and not spiked)
    if spike is not None:
        before += int(spike.skipped) - int(spiked)
    return before


def _scale_postfix(row: dict) -> dict:
    return {} if "loss_scale" not in row else {"scale": f"{row['loss_scale']:.0f}"}


def _warn_if_other_data(saved: dict, cfg: Config) -> None:
    """One line if the resumed run reads another data stream than the checkpoint's writer did
    (allowed, as in Megatron: continuing on new data is a choice, but rarely a silent one)."""
    now = data_identity(cfg)  # a checkpoint written before a key existed is not compared on it
    changed = [f"{k} {saved[k]} -> {v}" for k, v in now.items() if k in saved and saved[k] != v]
    if changed:
        _tell(f"jzero: note: the checkpoint was trained on other data ({', '.join(changed)}); continuing on this run's")


def _tell(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)
