"""Other frameworks' checkpoints in and out of jzero, without their code; Flax models into a ZeRO step.

`flax` runs a Flax Linen or NNX model's row-parallel layers and blocks as `build_zero`'s flat path and
FSDP units need (docs/flax.md).

`megatron` moves a run between Megatron-LM's distributed optimizer and jzero (docs/megatron.md,
"Moving a run between Megatron and jzero"); `torch_format` and `torch_dist` read (and the
former writes) PyTorch's files with numpy alone: torch is never imported and no code stored in
a file is ever run. Every failure of a checkpoint is an `InteropError`, one line that names the file.
"""

from jzero.errors import CheckpointError


class InteropError(CheckpointError):
    """A foreign checkpoint jzero cannot read (damaged, foreign, or holding code), or one that does
    not fit the model; the message names the file and what to do."""
