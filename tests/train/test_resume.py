"""jzero.train.resume: which directory `--resume` reads; `checkpoint.dir` with no step yet starts from step 0."""

import pytest

from helpers import tiny_config
from jzero.errors import CheckpointError
from jzero.train import ckpt_dir
from jzero.train.resume import resolve_resume_dir


def test_the_checkpoint_dir_without_a_step_starts_from_step_0(tmp_path):
    ck = tmp_path / "ck"
    cfg = tiny_config(checkpoint={"dir": str(ck)})
    assert resolve_resume_dir(cfg, None) is None  # missing
    ck.mkdir()
    assert resolve_resume_dir(cfg, None) is None  # empty
    ckpt_dir.claim(ck, "sha", resume=False).release()  # marked by a run that saved nothing
    assert resolve_resume_dir(cfg, str(ck)) is None
    (ck / ckpt_dir.DAMAGED).mkdir()  # every step it saved was damaged: not a fresh start
    assert resolve_resume_dir(cfg, None) == ck.resolve()


def test_any_other_directory_must_be_jzeros(tmp_path):
    with pytest.raises(CheckpointError, match=r"^--resume needs a directory: pass one or set checkpoint.dir$"):
        resolve_resume_dir(tiny_config(), None)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_resume_dir(tiny_config(), str(tmp_path / "elsewhere"))
    (tmp_path / "foreign").mkdir()
    with pytest.raises(CheckpointError, match="is not a jzero checkpoint directory"):
        resolve_resume_dir(tiny_config(), str(tmp_path / "foreign"))


def test_a_symlink_loop_is_one_line(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(CheckpointError, match=f"^--resume {loop} cannot be resolved: "):
        resolve_resume_dir(tiny_config(), str(loop))
    with pytest.raises(CheckpointError, match=f"^checkpoint.dir {loop} cannot be resolved: "):
        resolve_resume_dir(tiny_config(checkpoint={"dir": str(loop)}), None)
    with pytest.raises(CheckpointError, match=f"^checkpoint.dir {loop} cannot be resolved: "):
        resolve_resume_dir(tiny_config(checkpoint={"dir": str(loop)}), str(tmp_path))
