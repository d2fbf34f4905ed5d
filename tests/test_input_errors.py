"""Bad input to `jzero train` is one line on stderr naming it, and exit code 2, before JAX starts.

(More config keys in test_cli.py's `test_bad_input_is_one_clear_line`.)
"""

import os
import sys
from pathlib import Path

import pytest

from jzero import cli


@pytest.fixture(autouse=True)
def no_jax(monkeypatch):
    """Each input here must be rejected before JAX starts: nothing compiles, nothing is created."""

    def start(*_):
        raise AssertionError("JAX started before the bad input was rejected")

    monkeypatch.setattr(cli, "_start", start)


def error_line(argv: list[str], capsys) -> str:
    """`jzero <argv>`'s stderr, checked to be one `jzero: error:` line with exit code 2."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jzero: error: ") and err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.lr=nan", "optimizer.lr=nan must be a finite number"),
        ("optimizer.lr=.inf", "optimizer.lr=inf must be a finite number"),
        ("optimizer.lr=0", "optimizer.lr=0.0 must be positive"),
        ("optimizer.b1=5", "optimizer.b1=5.0 must be in [0, 1)"),
        ("optimizer.b1=-0.1", "optimizer.b1=-0.1 must be in [0, 1)"),
        ("optimizer.b2=1", "optimizer.b2=1.0 must be in [0, 1)"),
        ("optimizer.eps=-1", "optimizer.eps=-1.0 must be positive"),
        ("optimizer.eps=0", "optimizer.eps=0.0 must be positive"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1 must be >= 0"),
        ("optimizer.weight_decay=nan", "optimizer.weight_decay=nan must be a finite number"),
        ("optimizer.clip_grad=0", "optimizer.clip_grad=0.0 must be positive"),
        ("optimizer.clip_grad=inf", "optimizer.clip_grad=inf must be a finite number"),
        ("optimizer.param_groups=[{pattern: a, lr_mult: .inf}]",
         "optimizer.param_groups[0].lr_mult=inf must be a finite number"),
    ],
)
def test_bad_optimizer_value(override, message, tmp_path, capsys):
    assert error_line(["train", "--out", str(tmp_path), "--set", override], capsys) == f"jzero: error: {message}"


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.grad_norm_spike_factor=1", "train.grad_norm_spike_factor=1.0 must be a finite number > 1 (null = off)"),
        ("train.grad_norm_spike_factor=nan", "train.grad_norm_spike_factor=nan must be a finite number"),
        ("train.grad_norm_spike_window=0", "train.grad_norm_spike_window=0 must be an integer >= 1"),
    ],
)
def test_bad_spike_guard_value(override, message, tmp_path, capsys):
    argv = ["train", "--out", str(tmp_path), "--set", "train.grad_norm_spike_factor=3", "--set", override]
    assert error_line(argv, capsys) == f"jzero: error: {message}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["launch", "--local", "\u00b2"], "--local N needs a number of processes >= 1 first, got '\u00b2'"),
        (["launch", "--local", "2", "--process-id", "0"], "jzero launch gives each process --coordinator, "
         "--num-processes and --process-id: drop --process-id"),  # 0 was taken for "not given"
        (["train", "--set", "checkpoint.timeout_s=10000000000"], "checkpoint.timeout_s=10000000000 must be < 2**31 "
         "seconds"),  # an OverflowError after the first save
        (["train", "--set", "distributed.timeout_s=2147483648"], "distributed.timeout_s=2147483648 must be < 2**31 "
         "seconds"),  # a TypeError in JAX's distributed runtime once the processes had started
        (["train", "--set", "optimizer.name=optax", "--set", "optimizer.optax.name=lion", "--set",
          "optimizer.optax.args={b1: 0.9, b2: [0.99, .nan]}"], "optimizer.optax.args.b2[1]=nan must be a finite "
         "number"),  # trained until the grad norm was NaN
    ],
)  # fmt: skip
def test_values_refused_before_anything_starts(argv, message, tmp_path, capsys):
    if argv[0] == "train":
        argv = [*argv[:1], "--out", str(tmp_path / "o"), *argv[1:]]
    assert error_line(argv, capsys) == f"jzero: error: {message}"


def test_a_fifo_a_symlink_loop_and_zero_processes_are_named_as_what_they_are(tmp_path, capsys):
    """Before: "is a file", "does not exist", and "--process-id 0 must be in [0, 0)"."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    err = error_line(["ckpt", "info", str(tmp_path / "fifo")], capsys)
    assert err.endswith("fifo is not a directory (a FIFO, socket or device)")
    err = error_line(["train", str(tmp_path / "loop")], capsys)
    assert err.endswith("loop is a symbolic link to nothing (a missing target, or a loop)")
    argv = ["train", "--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"]
    assert error_line(argv, capsys) == "jzero: error: --num-processes 0 must be >= 1"


def test_an_integer_of_5000_digits_is_one_line_and_named_short(tmp_path, capsys):
    """Python refuses int() of over 4300 digits: a traceback from PyYAML's constructor, and the --set echoed whole."""
    err = error_line(["train", "--out", str(tmp_path), "--set", f"model.d_model={'9' * 5000}"], capsys)
    assert err.startswith("jzero: error: --set 'model.d_model=999") and "Exceeds the limit" in err and len(err) < 400
    path = tmp_path / "c.yaml"
    path.write_text(f"model:\n  d_model: {'9' * 5000}\n")
    err = error_line(["train", str(path), "--out", str(tmp_path / "o")], capsys)
    assert err.startswith(f"jzero: error: config file {path} is not valid YAML: ValueError: Exceeds the limit"), err


@pytest.mark.parametrize("value", ["[", "{a", "'"])
def test_set_value_that_is_not_yaml(value, tmp_path, capsys):
    err = error_line(["train", "--out", str(tmp_path), "--set", f"train.steps={value}"], capsys)
    assert err.startswith(f"jzero: error: --set {f'train.steps={value}'!r}: the value {value!r} is not valid YAML")


def test_out_is_a_file(tmp_path, capsys):
    out = tmp_path / "run"
    out.write_text("mine")
    assert error_line(["train", "--out", str(out)], capsys) == f"jzero: error: --out {out} is a file, not a directory"
    assert out.read_text() == "mine"


def test_out_is_under_a_file(tmp_path, capsys):
    out = tmp_path / "file" / "a" / "run"
    out.parents[1].write_text("mine")
    err = error_line(["train", "--out", str(out)], capsys)
    assert err == f"jzero: error: --out {out}: {out.parents[1]} is a file, not a directory"
    assert sorted(tmp_path.iterdir()) == [out.parents[1]]


def test_out_is_a_dangling_symlink(tmp_path, capsys):
    """Before, "dangl: File exists" (os.mkdir on the link)."""
    out = tmp_path / "dangl"
    out.symlink_to(tmp_path / "gone")
    err = error_line(["train", "--out", str(out)], capsys)
    assert err == f"jzero: error: --out {out} is a symbolic link to {tmp_path / 'gone'}, which does not exist"


def test_data_prepare_under_a_file(tmp_path, capsys):
    """Before, "afile: File exists" (mkdir of OUT_PREFIX's parents)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("hello")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    err = error_line(["data", "prepare", str(tmp_path / "src"), str(afile / "p")], capsys)
    assert err == f"jzero: error: OUT_PREFIX {afile / 'p'}: {afile} is a file, not a directory"
    assert afile.read_text() == "mine"


def test_config_file_that_is_a_fifo(tmp_path, capsys):
    """Before, "does not exist"."""
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    err = error_line(["train", str(fifo)], capsys)
    assert err == f"jzero: error: config file {fifo} is not a regular file (a FIFO, socket or device)"


def test_out_is_not_writable(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:  # root passes every permission check: answer as anyone else would
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and access(p, mode))
    out = locked / "run"
    err = error_line(["train", "--out", str(out)], capsys)
    assert err == f"jzero: error: --out {out}: directory {locked} is not writable"
    assert list(locked.iterdir()) == []


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("42\n", "int"), ("just words\n", "str")])
@pytest.mark.parametrize("sets", [[], ["--set", "train.steps=1"]])
def test_config_file_that_is_not_a_mapping(text, kind, sets, tmp_path, capsys):
    """Before, with --set this was an AttributeError traceback (--set indexed into the list)."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    err = error_line(["train", str(path), "--out", str(tmp_path / "run"), *sets], capsys)
    assert err.startswith(f"jzero: error: config file {path} must be a mapping of sections") and kind in err


def test_the_python_apis_train_refuses_another_runs_out_as_the_cli_does(tmp_path):
    """`jzero.train.loop.train(cfg, out)` replaced another run's metrics.jsonl and summary.json, which the CLI's
    --out refuses."""
    from helpers import tiny_config
    from jzero.config import ConfigError
    from jzero.train.loop import train

    (tmp_path / "metrics.jsonl").write_text("theirs\n")
    with pytest.raises(ConfigError, match=f"^out_dir {tmp_path} holds another run's metrics.jsonl"):
        train(tiny_config(), tmp_path, progress=False)
    assert (tmp_path / "metrics.jsonl").read_text() == "theirs\n" and not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("files", [["metrics.jsonl"], ["summary.json"], ["metrics.jsonl", "summary.json"]])
def test_a_fresh_run_into_another_runs_out_is_refused(files, tmp_path, capsys):
    """--out is owned like checkpoint.dir: before, a fresh run replaced the earlier run's files."""
    for f in files:
        (tmp_path / f).write_text("theirs\n")
    err = error_line(["train", "--out", str(tmp_path)], capsys)
    assert err.startswith(f"jzero: error: --out {tmp_path} holds another run's {' and '.join(files)}")
    assert "--resume" in err
    assert all((tmp_path / f).read_text() == "theirs\n" for f in files)


def test_config_file_that_is_not_utf8(tmp_path, capsys):
    """Before, a UnicodeDecodeError traceback."""
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\x00\x01\xff\xfe")
    assert error_line(["train", str(path)], capsys) == f"jzero: error: config file {path} is not UTF-8 text"


def test_config_file_with_a_nul(tmp_path, capsys):
    """UTF-8, but a character YAML refuses: before, a message of two lines."""
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\x00\x01")
    err = error_line(["train", str(path)], capsys)
    assert err.startswith(f"jzero: error: config file {path} is not valid YAML: unacceptable character #x0000")


def test_config_file_that_names_a_key_twice(tmp_path, capsys):
    """PyYAML keeps the last of two equal keys without a word: the second `keep` undid the first."""
    path = tmp_path / "c.yaml"
    path.write_text("checkpoint:\n  keep: 5\n  every: 10\n  keep: 3\n")
    err = error_line(["train", str(path)], capsys)
    assert err == (f"jzero: error: config file {path} is not valid YAML at line 4, column 3: "
                   "key 'keep' appears twice (first at line 2)")  # fmt: skip


def test_a_merge_may_override_a_key_and_a_set_may_not_name_one_twice(tmp_path, capsys):
    """A YAML merge (`<<: {...}` or `<<: *defaults`) overridden by the mapping's own key is no key named twice
    (the first check of duplicates refused every merge); a --set's flow mapping naming one twice is."""
    from jzero.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("checkpoint:\n  <<: {every: 50, keep: 2}\n  every: 5\n")
    assert (load_config(path).checkpoint.every, load_config(path).checkpoint.keep) == (5, 2)
    argv = ["train", "--out", str(tmp_path / "o"), "--set", "optimizer.optax.args={b1: 0.9, b1: 0.8}"]
    assert "key 'b1' appears twice" in error_line(argv, capsys)


@pytest.mark.parametrize("name", ["c.yaml", "conf"])
def test_config_path_that_is_a_directory(name, tmp_path, capsys, monkeypatch):
    """Before, "does not exist" (or, for a bare name, "no file and no preset")."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).mkdir()
    assert error_line(["train", name], capsys) == f"jzero: error: config file {name} is a directory, not a file"


@pytest.mark.parametrize(
    "text, key",
    [
        ("1: a\nfoo: b\n", "1"),
        ("train:\n  1: a\n  foo: b\n", "train.1"),
        ("model:\n  1: a\n  foo: b\n", "model.1"),
        ("model:\n  impl: helpers.toy_model:ToyModelWithOwnKeys\n  1: a\n  foo: b\n", "model.1"),
        ("optimizer:\n  param_groups:\n    - {pattern: a, 1: b, foo: c}\n", "optimizer.param_groups[0].1"),
    ],
)
def test_config_key_that_is_not_a_string(text, key, tmp_path, capsys):
    """Before, a TypeError traceback: sorting the unknown keys compared an int with a str."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert error_line(["train", str(path)], capsys).startswith(f"jzero: error: unknown config key {key} (known: ")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.seed=-1", "train.seed=-1 must be in [0, 2**63)"),
        ("train.seed=9223372036854775808", "train.seed=9223372036854775808 must be in [0, 2**63)"),
        *(
            (f"{key}=2147483648", f"{key}=2147483648 must be < 2**31 (a count the compiled step holds in int32)")
            for key in ("train.steps", "optimizer.warmup_steps", "precision.loss_scale_window", "precision.hysteresis")
        ),
        ("optimizer.warmup_steps=99999999999999999999999",
         "optimizer.warmup_steps=99999999999999999999999 must be < 2**31 (a count the compiled step holds in int32)"),
        ("train.host_devices=100000", "train.host_devices=100000 must be <= 4096 (simulated CPU devices of one "
         "process; JAX makes each as it starts)"),
        ("train.host_devices=0", "train.host_devices=0 must be positive"),
    ],
)
def test_seed_and_counts_out_of_range(override, message, tmp_path, capsys):
    """Before, a ValueError or OverflowError traceback from numpy's generator, jax.random.key or a jitted int32;
    train.host_devices=100000, minutes of JAX making CPU devices before the mesh check failed."""
    assert error_line(["train", "--out", str(tmp_path), "--set", override], capsys) == f"jzero: error: {message}"


@pytest.mark.parametrize(
    "source, why",
    [
        ("def f(:\n", "SyntaxError: invalid syntax"),
        ("raise RuntimeError('boom\\nsecond line')\n", "RuntimeError: boom)"),
        ("import sys\nsys.exit(0)\n", "SystemExit: 0)"),
    ],
)
@pytest.mark.parametrize("key", ["model.impl", "optimizer.optax.name"])
def test_module_that_fails_at_import(source, why, key, tmp_path, capsys, monkeypatch):
    """Before, the module's traceback (and for sys.exit(0), exit code 0 and no word)."""
    module = f"jzero_bad_{abs(hash((source, key)))}"
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sets = ["--set", "optimizer.name=optax"] if key == "optimizer.optax.name" else []
    err = error_line(["train", "--out", str(tmp_path / "run"), *sets, "--set", f"{key}={module}:M"], capsys)
    assert err.startswith(f"jzero: error: {key}='{module}:M': cannot import {module} ({why}")


def test_model_with_no_param_elements(tmp_path, capsys, monkeypatch):
    """Refused where the run is built (JAX is up: the test session's 8 CPU devices); before, a
    ZeroDivisionError traceback from the memory pre-flight's bytes per param."""
    monkeypatch.setattr(cli, "_start", lambda *_: None)
    argv = ["train", "--quiet", "--out", str(tmp_path / "run"), "--set", "data.kind=synthetic",
            "--set", "model.impl=helpers.toy_model:ToyModelWithOwnKeys", "--set", "model.d_model=0"]  # fmt: skip
    err = error_line(argv, capsys)
    assert err == (
        "jzero: error: the model has no parameter elements (its 5 params have 0 elements each): "
        "a ZeRO step has nothing to train"
    )


@pytest.mark.parametrize("path", ["flat", "owned", "spec"])
@pytest.mark.parametrize(
    "sets, rank, message",
    [
        (["mesh.dp=8"], 99, "--rank 99 is outside the data-parallel group of size 8"),
        (["mesh.dp=8"], 8, "--rank 8 is outside the data-parallel group of size 8"),
        (["mesh.dp=8"], -1, "--rank -1 is outside the data-parallel group of size 8"),
        (["mesh.dp=2", "mesh.dp_outer=2", "mesh.tp=2"], 4, "--rank 4 is outside the data-parallel group of size 4"),
        ([], -1, "--rank -1 must be >= 0 (a data-parallel rank)"),  # mesh.dp=-1: the size waits for the devices
    ],
)
def test_layout_rank_out_of_range(path, sets, rank, message, capsys):
    """Before, zero.path=owned ignored --rank, and the flat path refused it only once the run was built."""
    argv = ["layout", "--rank", str(rank), "--set", f"zero.path={path}"]
    for s in sets:
        argv += ["--set", s]
    assert error_line(argv, capsys) == f"jzero: error: {message}"


def test_launch_refuses_more_processes_than_the_machine_holds(capsys, monkeypatch):
    """Before, `--local 100000` went on starting processes (a load of 141 on 2 cores) until killed."""
    from jzero import launch

    monkeypatch.setattr(launch, "run_local", lambda *_: pytest.fail("processes started"))
    n = launch.max_local() + 1
    assert error_line(["launch", "--local", str(n)], capsys) == (
        f"jzero: error: --local {n}: at most {n - 1} processes on this machine ({launch.cpus()} CPUs, 4 each); "
        "for more, run them on more hosts (docs/cluster.md)"
    )


def test_launch_starts_no_more_processes_once_one_has_failed(monkeypatch, capsys):
    """Each process here exits 3 at once (a real process, the launcher waiting for it before the next): the
    launcher starts no second one and reports the first's failure."""
    import subprocess

    from jzero import launch

    real, started = subprocess.Popen, []

    def failing(cmd, **kwargs):
        started.append(real([sys.executable, "-c", "raise SystemExit(3)"], **kwargs))
        started[-1].wait(timeout=60)
        return started[-1]

    monkeypatch.setattr(launch.subprocess, "Popen", failing)
    assert launch.run_local(5, []) == 3
    assert len(started) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == "jzero: error: process 0 of 5 exited with code 3; the run stopped"


@pytest.mark.parametrize("out_is", ["file", "another run's"])
def test_launch_checks_trains_input_once_before_starting_processes(out_is, tmp_path, capsys, monkeypatch):
    """Before, each of the N processes found the bad --out and said so: N copies of the line."""
    from jzero import launch

    monkeypatch.setattr(launch, "run_local", lambda *_: pytest.fail("processes started before the input was checked"))
    out = tmp_path / "out"
    if out_is == "file":
        out.write_text("mine")
        message = f"--out {out} is a file, not a directory"
    else:
        out.mkdir()
        (out / "metrics.jsonl").write_text("{}\n")
        message = (f"--out {out} holds another run's metrics.jsonl: a fresh run never replaces them; choose a new "
                   "--out, or continue that run with --resume")  # fmt: skip
    assert error_line(["launch", "--local", "3", "--out", str(out)], capsys) == f"jzero: error: {message}"
