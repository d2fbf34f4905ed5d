"""jzero.train.sinks: metrics.jsonl as strict JSON whatever the values, and the same scalars in TensorBoard
event files (`train.tensorboard_dir`) and a Weights & Biases run (`train.wandb_project`, offline here)."""

import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jzero.cli import main
from jzero.config import Config, load_config
from jzero.train import sinks

TINY = ["--set", "model.n_layers=1", "--set", "model.seq_len=16", "--set", "model.d_model=32", "--set", "model.d_ff=64"]


def strict_loads(line: str):
    """json.loads as jq and RFC 8259 read: NaN, Infinity and -Infinity are not JSON."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def strict_rows(path: Path) -> list[dict]:
    return [strict_loads(line) for line in path.read_text().splitlines()]


def train(tmp_path: Path, *sets: str, out: str = "out") -> tuple[int, Path]:
    argv = ["train", "--out", str(tmp_path / out), "--quiet"]
    for s in sets:
        argv += ["--set", s]
    return main(argv + TINY), tmp_path / out


# ---- strict JSON ------------------------------------------------------------------------------------------


def test_a_row_with_nan_and_inf_is_strict_json_that_names_them(tmp_path):
    row = {"step": 3, "loss": 2.5, "grad_norm": math.nan, "loss_scale": np.float32(np.inf), "x": -math.inf,
           "skipped": None}
    line = sinks.json_line(row)
    got = strict_loads(line)
    assert got == {"step": 3, "loss": 2.5, "grad_norm": None, "loss_scale": None, "x": None, "skipped": None,
                   "nonfinite": {"grad_norm": "nan", "loss_scale": "inf", "x": "-inf"}}
    assert strict_loads(sinks.json_line({"step": 1, "loss": 1.0})) == {"step": 1, "loss": 1.0}  # no `nonfinite`
    (tmp_path / "metrics.jsonl").write_text(line + '{"step": 4, "lo')  # a last line cut short by a kill
    (back,) = sinks.read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(back["grad_norm"]) and back["loss_scale"] == math.inf and back["x"] == -math.inf
    assert back["skipped"] is None and "nonfinite" not in back
    summary = sinks.dumps({"a": [1.0, math.nan], "b": {"c": math.inf}}, indent=2)
    assert strict_loads(summary) == {"a": [1.0, None], "b": {"c": None}}


def test_sinks_write_strict_rows_and_a_resume_rewrites_older_ones_strictly(tmp_path):
    """A row with a NaN grad norm goes out strict; a resumed run keeps the rows up to its step, rewriting an
    older jzero's bare NaN as strict JSON, and drops the later ones and a line cut short."""
    with sinks.open_sinks(Config(), tmp_path, 0) as f:
        f.write({"step": 1, "loss": 3.0, "grad_norm": math.nan})
    assert strict_rows(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": 3.0, "grad_norm": None, "nonfinite": {"grad_norm": "nan"}}
    ]
    old = ['{"step": 1, "loss": 3.0, "grad_norm": NaN}', '{"step": 2, "loss": 2.0, "grad_norm": Infinity}',
           '{"step": 3, "loss": 1.0, "grad_norm": 1.0}', '{"step": 4, "lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(old) + "\n")
    with sinks.open_sinks(Config(), tmp_path, 2) as f:
        f.write({"step": 3, "loss": 0.5, "grad_norm": 0.25})
    assert strict_rows(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": 3.0, "grad_norm": None, "nonfinite": {"grad_norm": "nan"}},
        {"step": 2, "loss": 2.0, "grad_norm": None, "nonfinite": {"grad_norm": "inf"}},
        {"step": 3, "loss": 0.5, "grad_norm": 0.25},
    ]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="Linux's /dev/full: every write fails with ENOSPC")
def test_a_full_disk_names_the_file_it_could_not_write(tmp_path):
    """A write's OSError carries no file name: the CLI said "jzero: error: No space left on device"."""
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    with pytest.raises(OSError) as e, sinks.open_sinks(Config(), tmp_path, 0) as f:
        f.write({"step": 1, "loss": 3.0, "grad_norm": 1.0})
    assert e.value.strerror == "No space left on device" and e.value.filename == str(tmp_path / "metrics.jsonl")
    with pytest.raises(OSError) as e:
        sinks.write_summary(Path("/dev/full"), {"loss": 1.0})
    assert e.value.filename == "/dev/full"


def test_a_run_that_meets_a_nan_writes_strict_metrics(tmp_path):
    """A learning rate of 1e30 takes the loss or grad norm to NaN at step 2: the run stops (exit 2), and
    metrics.jsonl, its last row that step's, parses as strict JSON, the non-finite value null."""
    rc, out = train(tmp_path, "train.steps=4", "data.kind=synthetic", "optimizer.lr=1e30", "optimizer.warmup_steps=0")
    assert rc == 2
    rows = strict_rows(out / "metrics.jsonl")
    assert rows[-1]["step"] == 2 and None in (rows[-1]["loss"], rows[-1]["grad_norm"])
    assert all(r[k] is None for r in rows for k in r.get("nonfinite", {}))


# ---- TensorBoard and W&B ----------------------------------------------------------------------------------


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def wandb_records(run_file: Path) -> list:
    """The records of an offline W&B run's `.wandb` file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log records (crc32 4, length 2, type 1: full 1, first 2, middle 3, last 4) in 32 KiB blocks,
    each a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, part, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def wandb_history(run_file: Path) -> tuple[dict[int, dict], dict, str]:
    """{step: {key: value}} of the run's logged rows (wandb's own `_` keys left out), its config and name."""
    history, config, name = {}, {}, None
    for r in wandb_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind == "run":
            config = {u.key: json.loads(u.value_json) for u in r.run.config.update}
            name = r.run.display_name
    return history, config, name


@pytest.mark.slow
def test_tensorboard_and_wandb_get_the_metrics_jsonl_scalars(tmp_path, monkeypatch):
    """One run with both sinks: TensorBoard's reader and the offline W&B run hold every scalar of every
    metrics.jsonl row (validation loss included) by its name at its step; TensorBoard as float32."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    tb = tmp_path / "tb"
    rc, out = train(tmp_path, "train.steps=3", "train.eval_every=2", f"train.tensorboard_dir={tb}",
                    "train.wandb_project=jzero-test", out="run-a")
    assert rc == 0
    rows = strict_rows(out / "metrics.jsonl")
    expected = {k: {r["step"]: r[k] for r in rows if k in r} for r in rows for k in r if k != "step"}
    assert {"loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "val_loss"} <= set(expected)
    assert list(expected["val_loss"]) == [2, 3]

    scalars = tensorboard_scalars(tb)
    assert set(scalars) == set(expected)
    for tag, by_step in expected.items():
        assert scalars[tag] == {s: pytest.approx(float(np.float32(v)), rel=1e-7) for s, v in by_step.items()}, tag

    (run_file,) = (tmp_path / "wandb_dir").glob("wandb/offline-run-*/run-*.wandb")
    history, config, name = wandb_history(run_file)
    assert set(history) == {1, 2, 3}
    for step, logged in history.items():
        assert logged == {k: v[step] for k, v in expected.items() if step in v}
    assert config["train"]["wandb_project"] == "jzero-test" and config["model"]["d_model"] == 32
    assert name == "run-a"  # train.wandb_exp_name null: --out's name


@pytest.mark.slow
def test_a_resumed_cli_run_continues_its_tensorboard_curves(tmp_path):
    """Steps 1-3 with checkpoints at 2 and 3, step 3's lost (killed before its save): --resume from step 2
    to step 5 into the same tensorboard_dir (a fresh run is refused there) gives one curve, 1-5, with
    metrics.jsonl's values."""
    sets = ["data.kind=synthetic", f"train.tensorboard_dir={tmp_path / 'tb'}", f"checkpoint.dir={tmp_path / 'ck'}",
            "checkpoint.every=2"]
    assert train(tmp_path, *sets, "train.steps=3")[0] == 0
    shutil.rmtree(tmp_path / "ck" / "step_00000003")
    argv = ["train", "--out", str(tmp_path / "out"), "--quiet", "--resume"]
    assert main(argv + [a for s in [*sets, "train.steps=5"] for a in ("--set", s)] + TINY) == 0
    rows = strict_rows(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert tensorboard_scalars(tmp_path / "tb")["loss"] == {r["step"]: pytest.approx(r["loss"], rel=1e-7) for r in rows}
    assert len(list((tmp_path / "tb").iterdir())) == 2


def test_a_resumed_run_replaces_tensorboard_s_orphaned_steps(tmp_path):
    """Steps 1-4 written, then a run resumed from step 2 writes 3-5: TensorBoard's reader shows 1-2 of the
    first and 3-5 of the second (the START at step 3 drops the first's 3-4). A NaN goes in as a NaN."""
    for start, stop, value in ((0, 4, 1.0), (2, 5, 2.0)):
        tb = sinks._TensorBoard(str(tmp_path), start)
        for step in range(start + 1, stop + 1):
            tb.write(step, {"loss": value, "grad_norm": math.nan if step == 5 else value})
        tb.close(ok=True)
    scalars = tensorboard_scalars(tmp_path)
    assert scalars["loss"] == {1: 1.0, 2: 1.0, 3: 2.0, 4: 2.0, 5: 2.0}
    assert list(scalars["grad_norm"]) == [1, 2, 3, 4, 5] and math.isnan(scalars["grad_norm"][5])


def test_importing_jzero_imports_neither_tensorboard_nor_wandb():
    code = (
        "import sys, jzero, jzero.cli, jzero.train.loop, jzero.train.sinks; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorboard', 'wandb')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


# ---- bad input: one line, exit code 2 ---------------------------------------------------------------------


def test_the_keys_default_to_off():
    t = load_config().train
    assert (t.tensorboard_dir, t.wandb_project, t.wandb_exp_name, t.wandb_save_dir) == (None, None, None, None)


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["train.tensorboard_dir={file}"], "is a file, not a directory: give a directory"),
        (["train.tensorboard_dir={file}/tb"], "is a file, not a directory"),
        (["train.tensorboard_dir={events}"], "holds another run's TensorBoard event files"),
        (["train.tensorboard_dir={tmp}/tb", "missing=tensorboard"], "pip install 'jzero[tensorboard]'"),
        (["train.wandb_project=p", "missing=wandb"], "pip install 'jzero[wandb]'"),
        (["train.wandb_project=p", "train.wandb_save_dir={file}"], "train.wandb_save_dir="),
        (["train.wandb_exp_name=x"], "train.wandb_exp_name is set but train.wandb_project is null"),
        (["train.tensorboard_dir=' '"], "train.tensorboard_dir=' ' is empty"),
    ],
)
def test_bad_sink_input_is_one_line(sets, needle, tmp_path, capsys, monkeypatch):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "events.out.tfevents.1.host.1.0").write_bytes(b"")
    fill = {"file": tmp_path / "a_file", "events": tmp_path / "events", "tmp": tmp_path}
    argv = ["train", "--out", str(tmp_path / "out"), "--quiet", "--set", "data.kind=synthetic"]
    for s in sets:
        if s.startswith("missing="):  # the package not installed: its import fails
            module = s.split("=")[1]
            names = [m for m in list(sys.modules) if m == module or m.startswith(module + ".")]
            for name in names + [module]:
                monkeypatch.setitem(sys.modules, name, None)
        else:
            argv += ["--set", s.format(**fill)]
    assert main(argv + TINY) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
