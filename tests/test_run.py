"""`jzero.run.Run`: the validation loss, with and without a stop asked between its batches."""

import dataclasses

import numpy as np

from helpers import init_state, tiny_config
from jzero.train.loop import setup


def test_evaluate_asked_to_stop_between_batches_ends_there_and_otherwise_gives_the_same_loss():
    run = setup(tiny_config("optim_grads", train={"eval_batches": 4}))
    run = dataclasses.replace(run, val_dataset=run.dataset)  # synthetic data has no validation split
    state = init_state(run)
    plain = run.evaluate(state.params)
    asked = []
    asking = run.evaluate(state.params, stop=lambda: asked.append(1) and False)
    assert len(asked) == 4
    np.testing.assert_array_equal(asking["loss"], plain["loss"])
    asked.clear()
    assert run.evaluate(state.params, stop=lambda: asked.append(1) or len(asked) == 3) is None
    assert len(asked) == 3
