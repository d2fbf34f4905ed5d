"""Writes model_optim_rng.pt here: bucket1000's legacy model file as Megatron-LM's checkpointing.py saves
it, with its `args` (an argparse Namespace holding Megatron's enums, torch dtypes, paths, signals) and
`rng_state` (Python's, numpy's and torch's generators) and `rerun_state_machine` (not run by the tests).

Needs torch and megatron-core 0.16.1; run from this folder: python make.py
"""

import argparse
import pathlib
import random
import signal

import numpy as np
import torch
from megatron.core.enums import ModelType
from megatron.core.rerun_state_machine import RerunMode
from megatron.core.transformer.enums import AttnBackend

sd = torch.load("../bucket1000/ckpt_legacy/iter_0000010/mp_rank_00/model_optim_rng.pt", weights_only=True)
sd["args"] = argparse.Namespace(
    num_layers=1, hidden_size=37, data_parallel_size=4, overlap_grad_reduce=True, ddp_bucket_size=1000,
    params_dtype=torch.float32, attention_backend=AttnBackend.auto, model_type=ModelType.encoder_or_decoder,
    save=pathlib.PosixPath("/ckpts/run"), exit_signal=signal.SIGTERM, consumed_train_samples=160,
)  # fmt: skip
sd["rng_state"] = [{
    "random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
    "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {},
}]  # fmt: skip
sd["rerun_state_machine"] = {"mode": RerunMode.DISABLED}
torch.save(sd, "model_optim_rng.pt")
