"""jzero.interop.flax: a Flax Linen and an NNX GPT (docs/flax.md's code blocks, run as they stand) train
through `build_zero` to plain single-device optax's numbers on both paths with real tp specs (dp 4 x tp 2:
tp-local modules and row-parallel reductions on the flat path) and FSDP units (ZeRO-3); the row-parallel
layer is Megatron's (its bias added once, after the sum); a loss that never calls `unit` is one clear error.
Tolerances are tests/zero/test_fidelity.py's: losses 1e-5 relative, grad norms 1e-4, params 1e-4 per tensor."""

import re
import sys
import types
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from helpers import rel_param_errors
from jzero.errors import ConfigError
from jzero.interop.flax import nnx_row_parallel, row_parallel, units
from jzero.mesh import MeshConfig, make_mesh
from jzero.zero import ZeroConfig, build_zero

DOCS = Path(__file__).resolve().parents[2] / "docs" / "flax.md"
STEPS = 3


def doc_blocks(section: str) -> list[str]:
    """The ```python blocks of docs/flax.md's `## section`, in order."""
    text = DOCS.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _docs_module() -> types.ModuleType:
    """docs/flax.md's Linen and NNX models, specs and losses, as one module (its definitions only; the Linen
    training block runs in `test_the_docs_linen_run_matches_plain_optax`)."""
    module = types.ModuleType("flax_docs")
    sys.modules[module.__name__] = module  # Linen's dataclasses look their module up
    for code in (doc_blocks("Linen")[0], doc_blocks("NNX")[0]):
        exec(compile(code, str(DOCS), "exec"), module.__dict__)
    return module


DOC = _docs_module()
MODELS = {"linen": (DOC.loss_fn, DOC.init), "nnx": (DOC.nnx_loss_fn, DOC.nnx_init)}


def batches(n: int = STEPS) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 97, (16, 17)).astype(np.int32) for _ in range(n)]


def plain_optax(loss_fn, init, tx, data):
    """Plain single-device optax: per step (loss, grad norm), and the params after the last."""

    @jax.jit
    def step(params, opt, batch):
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss, optax.tree.norm(g)

    params, out = jax.jit(init)(), []
    opt = tx.init(params)
    for batch in data:
        params, opt, loss, norm = step(params, opt, batch)
        out.append((float(loss), float(norm)))
    return out, params


def assert_params_match(params, ref) -> None:
    errors = rel_param_errors(jax.device_get(params), jax.device_get(ref))
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, f"{worst}: {errors[worst]:.2e}"


def assert_trains_like_plain_optax(zero, loss_fn, init, tx) -> None:
    data = batches()
    state = zero.init_state(init)
    got = []
    for batch in data:
        state, metrics = zero.step(state, jax.device_put(batch, zero.batch_sharding))
        got.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    want, ref = plain_optax(loss_fn, init, tx, data)
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-5)
    np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], rtol=1e-4)
    assert_params_match(zero.full_params(state.params), ref)


def build(model: str, path: str, strategy: str, dp: int = 4, tp: int = 2, unit_blocks: bool = True, loss_fn=None):
    """`build_zero` of docs/flax.md's `model` as its Linen training block builds it, on dp x tp of the 8 devices."""
    doc_loss, init = MODELS[model]
    abstract = jax.eval_shape(init)
    mesh = make_mesh(MeshConfig(dp=dp, tp=tp), jax.devices()[: dp * tp])
    tx = optax.adamw(1e-2, weight_decay=0.1)
    zero = build_zero(loss_fn or doc_loss, tx, mesh, abstract, DOC.tp_specs(abstract), ZeroConfig(strategy, path),
                      units=units(abstract, "blocks") if unit_blocks else None)  # fmt: skip
    return zero, doc_loss, init, tx


# ---------------------------------------------------------------- fidelity


@pytest.mark.slow
def test_the_docs_linen_run_matches_plain_optax():
    """docs/flax.md's Linen training block, verbatim: ZeRO-3 on the flat path over dp 4 x tp 2, a tp-local module
    with its row-parallel `out` and `fc2`, one FSDP unit per block, each named by the default rule."""
    data = batches()
    namespace = dict(DOC.__dict__, batches=data)
    exec(compile(doc_blocks("Linen")[1], str(DOCS), "exec"), namespace)
    zero, state, metrics = namespace["zero"], namespace["state"], namespace["metrics"]
    assert [g.key for g in zero.flat.groups] == ["params/blocks_0", "params/blocks_1", ""]
    want, ref = plain_optax(DOC.loss_fn, DOC.init, namespace["tx"], data)
    np.testing.assert_allclose(float(metrics["loss"]), want[-1][0], rtol=1e-5)
    np.testing.assert_allclose(float(metrics["grad_norm"]), want[-1][1], rtol=1e-4)
    assert_params_match(zero.full_params(state.params), ref)


@pytest.mark.parametrize(
    "model, path, strategy, dp, tp",
    [
        pytest.param("nnx", "flat", "optim_grads_params", 4, 2, id="nnx-flat-zero3-dp4-tp2",
                     marks=pytest.mark.slow),  # tp-local NNX module
        pytest.param("linen", "spec", "optim_grads_params", 4, 2, id="linen-spec-zero3-dp4-tp2",
                     marks=pytest.mark.slow),  # global params: row_parallel a no-op, no tp_axis
        pytest.param("nnx", "spec", "optim_grads", 4, 2, id="nnx-spec-zero2-dp4-tp2", marks=pytest.mark.slow),
        pytest.param("linen", "flat", "optim", 8, 1, id="linen-flat-zero1-dp8",
                     marks=pytest.mark.slow),  # the flat path without tp: no tp_axis, whole params
    ],
)  # fmt: skip
def test_flax_models_train_like_plain_optax(model, path, strategy, dp, tp):
    """On the flat path each block is its own unit, by the default rule (ZeRO-1 with overlap lays out per unit too)."""
    zero, loss_fn, init, tx = build(model, path, strategy, dp, tp)
    if path == "flat":
        blocks = ["blocks/0", "blocks/1"] if model == "nnx" else ["params/blocks_0", "params/blocks_1"]
        assert [g.key for g in zero.flat.groups] == [*blocks, ""]
    assert_trains_like_plain_optax(zero, loss_fn, init, tx)


def scanned_linen():
    """docs/flax.md's Linen GPT with its blocks in one `nn.scan` (params [L, ...] under `params/blocks`)."""

    class ScannedBlock(DOC.Block):
        def __call__(self, x, _):
            return super().__call__(x), None

    class ScannedGPT(DOC.GPT):
        def setup(self):
            self.embed = nn.Embed(self.vocab, self.d)
            scan = nn.scan(ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
            self.blocks = scan(self.heads, self.mlp)
            self.ln_f = nn.LayerNorm()
            self.head = nn.Dense(self.vocab, use_bias=False)

        def __call__(self, tokens):
            x, _ = self.blocks(self.embed(tokens), None)
            return self.head(self.ln_f(x))

    def loss_fn(params, tokens, tp_axis=None):
        tp = 1 if tp_axis is None else jax.lax.axis_size(tp_axis)
        with row_parallel(tp_axis, "out", "fc2"), DOC.unit_calls("blocks", prevent_cse=False):
            logits = ScannedGPT(heads=4 // tp, mlp=64 // tp).apply(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss_fn, lambda: ScannedGPT().init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))


@pytest.mark.slow
def test_a_scanned_linen_stack_is_one_unit_per_layer():
    """`nn.scan`'s blocks: `unit_calls` runs each layer's slice through `unit` inside the scan, `units(...,
    stacked=True)` marks the [L, ...] stack, the flat path lays it out per layer (one unit `params/blocks`).
    Momentum SGD, not Adam: this model's first grad of fc1's bias has an element of 6e-8, which Adam turns
    into a full-size step, so the last bits of its fp32 sum (which the flat path adds in another order) move
    that bias by 3e-4 of its norm; every other param agrees to 1e-6. SGD's update is linear in the grads."""
    loss_fn, init = scanned_linen()
    abstract = jax.eval_shape(init)
    tx = optax.sgd(0.1, momentum=0.9)
    config, stack = ZeroConfig("optim_grads_params", "flat"), units(abstract, "blocks", stacked=True)
    zero = build_zero(loss_fn, tx, make_mesh(MeshConfig(dp=4, tp=2)), abstract, DOC.tp_specs(abstract), config,
                      units=stack)  # fmt: skip
    assert [(g.key, g.layers) for g in zero.flat.groups] == [("params/blocks", 2), ("", None)]
    assert_trains_like_plain_optax(zero, loss_fn, init, tx)


# ---------------------------------------------------------------- the helpers alone


def _on_tp(f, mesh, in_specs):
    """`f(*local_args, tp_axis="tp")` on each tp rank's blocks, in a shard_map over a tp-only mesh; out replicated."""
    return jax.jit(jax.shard_map(lambda *a: f(*a, tp_axis="tp"), mesh=mesh, in_specs=in_specs, out_specs=P()))


def test_row_parallel_sums_the_products_over_tp_and_adds_the_bias_once():
    """Megatron's RowParallelLinear: psum(x[..., F_tp] @ W[F_tp, D]) + b[D] is the global layer's output, for
    Linen's Dense and DenseGeneral and NNX's Linear (not psum of each rank's y + b: tp x the bias). Without
    tp_axis the layers are as they are."""
    mesh = make_mesh(MeshConfig(dp=1, tp=4), jax.devices()[:4])
    x = jax.random.normal(jax.random.key(1), (2, 3, 8))
    dense = nn.Dense(5, bias_init=nn.initializers.normal(1.0), name="fc2")
    general = nn.DenseGeneral(5, axis=(-2, -1), bias_init=nn.initializers.normal(1.0), name="out")
    x2 = x.reshape(2, 3, 4, 2)  # [B, T, H, K]: heads split over tp
    for layer, inputs, split in ((dense, x, P(None, None, "tp")), (general, x2, P(None, None, "tp", None))):
        variables = layer.init(jax.random.key(0), inputs)
        want = layer.apply(variables, inputs)
        kernel_spec = P("tp", *(None,) * (variables["params"]["kernel"].ndim - 1))
        specs = ({"params": {"kernel": kernel_spec, "bias": P()}}, split)

        def local(variables, inputs, tp_axis, layer=layer):
            with row_parallel(tp_axis, layer.name):
                return layer.apply(variables, inputs)

        np.testing.assert_allclose(_on_tp(local, mesh, specs)(variables, inputs), want, rtol=1e-5, atol=1e-5)
        with row_parallel(None, layer.name):
            np.testing.assert_array_equal(layer.apply(variables, inputs), want)

    model = _Fc2(rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    want = model.fc2(x)
    params = nnx.to_pure_dict(params)

    def nnx_local(params, x, tp_axis):
        return nnx_row_parallel(nnx.merge(graphdef, params), tp_axis, "fc2").fc2(x)

    nnx_specs = ({"fc2": {"kernel": P("tp", None), "bias": P()}}, P(None, None, "tp"))
    np.testing.assert_allclose(_on_tp(nnx_local, mesh, nnx_specs)(params, x), want, rtol=1e-5, atol=1e-5)
    assert nnx_row_parallel(model, None, "fc2").fc2 is model.fc2


class _Fc2(nnx.Module):
    def __init__(self, *, rngs):
        self.fc2 = nnx.Linear(8, 5, bias_init=nnx.initializers.normal(1.0), rngs=rngs)


def test_row_parallel_refuses_a_layer_that_is_not_a_linear():
    model = nn.LayerNorm(name="ln")
    variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
    with pytest.raises(ConfigError, match="ln is a LayerNorm; a row-parallel layer is an nn.Dense"):
        jax.shard_map(lambda v: _apply_row_parallel(model, v), mesh=make_mesh(MeshConfig(dp=1, tp=2),
                      jax.devices()[:2]), in_specs=P(), out_specs=P())(variables)  # fmt: skip


def _apply_row_parallel(model, variables):
    with row_parallel("tp", "ln"):
        return model.apply(variables, jnp.ones((2, 4)))


def test_units_marks_each_blocks_params():
    """`units`: 0 for a param in a selected block (Linen's list attribute `blocks_0`, NNX's `blocks/0`, a
    compact `Block_0`), 1 for a scanned stack, None outside; as `build_zero`'s `units=`."""
    linen = {"params": {"blocks_0": {"fc1": {"kernel": 1}}, "Block_1": {"w": 1}, "embed": {"embedding": 1},
                        "blocks": {"w": 1}}}  # fmt: skip
    assert units(linen, "blocks") == {"params": {"blocks_0": {"fc1": {"kernel": 0}}, "Block_1": {"w": None},
                                                 "embed": {"embedding": None}, "blocks": {"w": 0}}}  # fmt: skip
    assert units(linen, "Block")["params"]["Block_1"] == {"w": 0}
    assert units({"params": {"blocks": {"w": 1}}}, "blocks", stacked=True) == {"params": {"blocks": {"w": 1}}}
    nnx_params = jax.eval_shape(DOC.nnx_init)
    marked = units(nnx_params, "blocks")
    assert set(jax.tree.leaves(marked["blocks"])) == {0} and jax.tree.leaves(marked["embed"]) == []  # None: no leaf


# ---------------------------------------------------------------- mistakes


def _linen_loss_without_unit_calls(params, tokens, tp_axis=None):
    tp = 1 if tp_axis is None else jax.lax.axis_size(tp_axis)
    with row_parallel(tp_axis, "out", "fc2"):
        logits = DOC.GPT(heads=4 // tp, mlp=64 // tp).apply(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _nnx_loss_without_unit_calls(params, tokens, tp_axis=None):
    model = nnx.merge(DOC.graphdef(1 if tp_axis is None else jax.lax.axis_size(tp_axis)), params)
    nnx_row_parallel(model, tp_axis, "out", "fc2")
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]), tokens[:, 1:]).mean()


def _trace_step(zero, init) -> None:
    """Traces (and lowers) the step on abstract state and batch: where the loss's trace fails, it fails here."""
    state = jax.eval_shape(lambda: zero.init_state(init))
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, zero.shardings)
    zero.step.lower(state, jax.ShapeDtypeStruct((16, 17), jnp.int32, sharding=zero.batch_sharding))


@pytest.mark.parametrize(
    "model, path, strategy, loss_fn, says",
    [
        ("linen", "spec", "optim_grads_params", _linen_loss_without_unit_calls, "ScopeParamShapeError"),
        ("linen", "flat", "optim_grads", _linen_loss_without_unit_calls, "GroupRef"),
        ("nnx", "flat", "optim_grads_params", _nnx_loss_without_unit_calls, "GroupRef"),
    ],
    ids=["linen-spec-zero3", "linen-flat-zero2", "nnx-flat-zero3"],
)
def test_units_marked_without_unit_calls_is_one_error_naming_the_fix(model, path, strategy, loss_fn, says):
    """`units=` given and the Flax module applied to the params as they are: Flax's ScopeParamShapeError or a
    TypeError on jzero's unit leaves before; now one ConfigError naming `units=` and `jzero.zero.unit`, the
    module's own error in brackets."""
    zero, _, init, _ = build(model, path, strategy, loss_fn=loss_fn)
    says = (r"build_zero\(units=\.\.\.\).*blocks.*none of them to a unit call.*jzero\.zero\.unit\(fn, block_params, "
            rf"x\).*docs/flax\.md.*{says}")  # fmt: skip
    with pytest.raises(ConfigError, match=says):
        _trace_step(zero, init)


@pytest.mark.slow
def test_outside_a_zero_step_unit_calls_are_plain_calls():
    """On one device (and in `init`, inference) `unit` is `fn(params, x)`: the docs' losses with `unit_calls`
    and `nnx_unit_calls` are the same functions as without them."""
    tokens = batches(1)[0]
    withouts = (_linen_loss_without_unit_calls, _nnx_loss_without_unit_calls)
    for (loss_fn, init), without in zip(MODELS.values(), withouts):
        both = jax.jit(lambda params, tokens: (loss_fn(params, tokens), without(params, tokens)))  # noqa: B023
        with_units, plain = both(init(), tokens)
        assert float(with_units) == float(plain)
