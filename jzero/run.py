"""A run from a config: the model `model.impl` names, its ZeRO optimizer on the mesh, and `Run`,
which the harness (`jzero.train.loop`) trains and the inspect tools (`jzero.inspect.compile`)
compile. Nothing here reads data: the harness attaches its datasets to the `Run` it gets."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jzero.config import GPT_IMPL, AttentionImpl, Config, ConfigError, resolve_mesh
from jzero.config_checks import spike_guard
from jzero.mesh import make_mesh
from jzero.model import Model, make_model, model_state, training_loss, unit_key
from jzero.optim import inner_optimizer, loss_scaling, param_groups
from jzero.zero import Zero, build_zero
from jzero.zero.common.state import TrainState


@dataclasses.dataclass
class Run:
    """Everything one training run is built from; see `build_run` (and `jzero.train.loop.setup`)."""

    cfg: Config  # mesh.dp resolved
    model: Model
    zero: Zero  # plan, shardings, init, step, grads, evaluate: built once by jzero.zero.build_zero
    dataset: Any = None  # the training data (`jzero.train.data`), None for compile-only tools
    val_dataset: Any = None  # validation data (`data.val_path` / `data.val_fraction`), None if none

    @property
    def mesh(self) -> Mesh:
        return self.zero.mesh

    def init_state(self) -> TrainState:
        return self.zero.init_state(self.model.init)

    def device_batch(self, step: int, dataset: Any = None) -> jax.Array:
        """The global batch of `step` of `dataset` (default: the training data), int32 `[B, seq_len + 1]`
        with B split over the dense DP domain (`batch_sharding`).

        Each process reads from the dataset only the rows its own devices hold, so no process
        materialises the whole global batch; a row is a pure function of (seed, step, row), so
        every process's rows belong to the same global batch.
        """
        dataset = self.dataset if dataset is None else dataset
        shape = dataset.shape
        rows: dict[tuple[int, int], np.ndarray] = {}  # tp replicas hold the same rows: read them once

        def shard(index: tuple[slice, ...]) -> np.ndarray:
            start, stop, _ = index[0].indices(shape[0])
            if (start, stop) not in rows:
                rows[start, stop] = dataset.rows(step, start, stop)
            return rows[start, stop][(slice(None), *index[1:])]

        return jax.make_array_from_callback(shape, self.zero.batch_sharding, shard)

    def evaluate(self, params, model_state=None, stop: Callable[[], bool] | None = None) -> dict[str, float] | None:
        """The validation loss (and the loss's metrics): the mean over `train.eval_batches` global batches
        of the validation data, batch i its "step" i, so every evaluation reads the same rows.

        Each batch runs `Zero.evaluate`, the step's forward without grads, on the params' shardings,
        with `model_state` (the train state's; None: the model's initial state, if it keeps one).
        stop: asked before each batch (on every process alike: it may be a collective), with at most one
        batch in flight and the next one loaded: batch i is dispatched, batch i + 1 read onto the devices,
        then batch i - 1 waited for before stop is asked again, so the device keeps batch i while the
        host reads and asks (where stop is a collective on several processes, it runs after batch i on
        the device, and batch i + 1 is there already); where it says True, the evaluation ends there and
        returns None, its save behind at most one batch (a SIGTERM's must not wait for the rest).
        """
        n = self.cfg.train.eval_batches
        total = previous = None
        batch = self.device_batch(0, self.val_dataset) if n else None
        for i in range(n):
            if stop is not None and stop():
                return None
            m = self.zero.evaluate(params, batch, model_state)
            total = m if total is None else jax.tree.map(jnp.add, total, m)
            batch = self.device_batch(i + 1, self.val_dataset) if i + 1 < n else None
            if stop is not None:
                if previous is not None:
                    jax.block_until_ready(previous)  # the total through batch i - 1
                previous = total
        return {k: float(v) / n for k, v in jax.device_get(total).items()}

    def evaluates_at(self, step: int) -> bool:
        """Whether the loop evaluates after `step` steps: every `train.eval_every` and at the last."""
        every, last = self.cfg.train.eval_every, self.cfg.train.steps
        return self.val_dataset is not None and every > 0 and (step % every == 0 or step == last)


def build_run(cfg: Config, devices: list | None = None) -> Run:
    """Resolves the mesh, model and ZeRO run for `cfg` (raises ConfigError on misfit), without data.

    This is where a config meets its devices (default: all of JAX's devices, every process's),
    so `mesh.dp=-1` is filled in here, once; `Run.cfg` is the resolved config. The model is the
    class `model.impl` names (`jzero.model.make_model`), its loss called with (params, batch).
    """
    devices = jax.devices() if devices is None else devices
    if cfg.model.impl == GPT_IMPL and cfg.model.attention == AttentionImpl.CUDNN and devices[0].platform == "cpu":
        raise ConfigError("model.attention=cudnn runs on GPUs only and these devices are CPUs; use auto or xla")
    cfg = resolve_mesh(cfg, len(devices))
    mesh = make_mesh(cfg.mesh, devices)
    model = make_model(cfg)
    abstract = model.abstract_params()
    zero = build_zero(
        training_loss(model),
        inner_optimizer(cfg, model),
        mesh,
        abstract,
        model.tp_specs(abstract),
        cfg.zero,
        is_expert=model.is_expert(abstract),
        units=model.units(abstract),
        unit_key=unit_key(model),
        groups=param_groups(cfg, model, abstract),
        clip_grad=cfg.optimizer.clip_grad,
        microbatches=cfg.train.microbatches,
        grad_reduce_dtype=jnp.dtype(cfg.precision.grad_reduce_dtype.value),
        has_aux=True,
        loss_scale=loss_scaling(cfg),
        model_state=model_state(model),
        skip_nonfinite=cfg.train.check_for_nan_in_loss_and_grad,
        spike_guard=spike_guard(cfg.train),
    )
    return Run(cfg, model, zero)
