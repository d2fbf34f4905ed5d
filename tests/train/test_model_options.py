"""The model's LLaMA options (swiglu, rmsnorm, no bias, GQA, rope) and its scan/remat forms."""

import dataclasses
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from helpers import assert_matches_reference, reference_run, rel_param_errors, run_steps, tiny_config
from jzero.config import AttentionImpl, ConfigError, ModelConfig, MoEConfig, PosKind, RematKind, load_config
from jzero.run import build_run
from jzero.train.layers import Attention, Keys, project
from jzero.train.model import GPTModel, _logsumexp, cross_entropy, head_logits

ROOT = Path(__file__).resolve().parents[2]
LLAMA_TINY = dict(mlp="swiglu", norm="rmsnorm", bias=False, n_kv_heads=2, pos="rope")


@pytest.mark.slow
def test_scan_and_remat_are_the_same_model():
    """Stacked params are the loop's params; loss and grads agree to fp32 rounding (XLA fuses
    the scanned / rematerialised forward differently, so sums re-associate)."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=8)
    tokens = np.arange(18).reshape(2, 9) * 7 % 64

    def run(**kw):
        model = GPTModel(dataclasses.replace(cfg, **kw))
        params = jax.jit(model.init)()
        loss, grads = jax.jit(jax.value_and_grad(model.loss))(params, tokens)
        return model, *jax.device_get((params, loss, grads))

    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
    _, params, loss, grads = run()
    _, _, loss_remat, grads_remat = run(remat=True)
    close(loss_remat, loss)
    jax.tree.map(close, grads_remat, grads)

    model, stacked, loss_scan, grads_scan = run(scan_layers=True, remat=True)
    close(loss_scan, loss)
    specs = model.tp_specs(stacked)
    assert specs["blocks"]["mlp"]["fc1"]["kernel"] == P(None, None, "tp")  # [L, D, F_tp]
    assert specs["blocks"]["attn"]["proj"]["kernel"] == P(None, "tp", None, None)  # [L, H_tp, K, D]
    for i in range(cfg.n_layers):
        layer = jax.tree.map(lambda a, i=i: a[i], (stacked["blocks"], grads_scan["blocks"]))
        jax.tree.map(np.testing.assert_array_equal, layer[0], params["blocks"][i])
        jax.tree.map(close, layer[1], grads["blocks"][i])


@pytest.mark.parametrize("scan", [True, False])
def test_remat_in_the_scan_has_no_cse_barrier(scan):
    """In the layer scan a block's recompute carries no optimization barrier (`unit(...,
    prevent_cse=False)`), which would hide ZeRO-3's backward gathers from XLA's collective
    pipeliner (docs/overlap.md); unrolled blocks keep theirs, or XLA could merge a recompute with
    its forward."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=8, scan_layers=scan,
                      remat=True)  # fmt: skip
    model = GPTModel(cfg)
    params = jax.eval_shape(model.init)
    tokens = jax.ShapeDtypeStruct((2, 9), jnp.int32)
    text = jax.jit(jax.grad(model.loss)).lower(params, tokens).as_text()
    assert ("optimization_barrier" in text) == (not scan)


@pytest.mark.slow
def test_gqa_rope_attention_matches_a_naive_reference():
    """Head h = g * R + r reads kv group g; rope in LLaMA's rotate-half form."""
    cfg = ModelConfig(d_model=64, n_heads=8, n_kv_heads=2, pos=PosKind.ROPE, bias=False)
    attn = Attention(cfg, nnx.Rngs(0), jnp.float32, 0.02)
    x = jax.random.normal(jax.random.key(2), (2, 10, 64))
    w = attn.qkv["kernel"][...]  # [D, R + 2, G, K]
    r, g, k = w.shape[1] - 2, w.shape[2], w.shape[3]
    q = jnp.einsum("btd,drgk->btgrk", x, w[:, :r]).reshape(2, 10, g * r, k)
    key = jnp.repeat(jnp.einsum("btd,dgk->btgk", x, w[:, r]), r, axis=2)
    value = jnp.repeat(jnp.einsum("btd,dgk->btgk", x, w[:, r + 1]), r, axis=2)

    def rotate(y):  # y [B, T, H, K]
        angle = jnp.arange(10)[:, None] / 10000 ** (jnp.arange(0, k, 2) / k)
        angle = jnp.concatenate([angle, angle], -1)[None, :, None]
        half = jnp.concatenate([-y[..., k // 2 :], y[..., : k // 2]], -1)
        return y * jnp.cos(angle) + half * jnp.sin(angle)

    scores = jnp.einsum("bthk,bshk->bhts", rotate(q), rotate(key)) / math.sqrt(k)
    scores = jnp.where(jnp.tril(jnp.ones((10, 10), bool)), scores, -1e30)
    out = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores, -1), value)
    ref = jnp.einsum("bthk,hkd->btd", out, attn.proj["kernel"][...])
    np.testing.assert_allclose(nnx.jit(lambda a, x: a(x))(attn, x), ref, atol=1e-6)


@pytest.mark.parametrize("name, count", [("llama2_7b", 6_738_415_616), ("llama2_70b", 68_976_648_192)])
@pytest.mark.slow
def test_llama_presets_have_the_public_param_counts(name, count):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    abstract = GPTModel(cfg.model, param_dtype=jnp.bfloat16).abstract_params()
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(abstract)) == count


@pytest.mark.parametrize("path", ["spec", "flat"])
@pytest.mark.slow
def test_llama_options_match_single_device_optax(path):
    """Every option at once, tp=2 splitting the kv groups and the swiglu pair, vs plain optax."""
    model = {**LLAMA_TINY, "scan_layers": True, "remat": True}
    assert_matches_reference(tiny_config("optim_grads", (4, 1, 2), 1, model=model, zero={"path": path}))


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.n_kv_heads=3"], "model.n_heads=4 must be divisible by model.n_kv_heads=3"),
        (["model.n_kv_heads=1", "mesh.dp=4", "mesh.tp=2"], "model.n_kv_heads=1 must be divisible by mesh.tp=2"),
        (["model.pos=rope", "model.d_model=12", "model.n_heads=4"], "even head dim"),
        (["model.mlp=relu"], "model.mlp='relu' is not one of: gelu, gelu_exact, swiglu"),
    ],
)
def test_bad_model_options(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


def test_swiglu_with_biases():
    """swiglu with model.bias: fc1's bias [2, F] adds its gate row to the gate and its up row to up
    (it used to be added to the stacked [2, B, T, F] pair, which does not broadcast)."""
    from jzero.train.layers import MLP

    cfg = ModelConfig(vocab_size=64, d_model=8, n_layers=1, n_heads=2, d_ff=6, seq_len=4, mlp="swiglu", bias=True)
    mlp = MLP(cfg, nnx.Rngs(0), jnp.float32, 0.02)
    rng = np.random.default_rng(0)
    for layer in (mlp.fc1, mlp.fc2):
        layer["bias"] = nnx.Param(jnp.asarray(rng.standard_normal(layer["bias"].shape), jnp.float32))
    x = rng.standard_normal((2, 4, 8)).astype(np.float32)
    w1, b1 = np.asarray(mlp.fc1["kernel"][...]), np.asarray(mlp.fc1["bias"][...])
    w2, b2 = np.asarray(mlp.fc2["kernel"][...]), np.asarray(mlp.fc2["bias"][...])
    gate, up = x @ w1[:, 0] + b1[0], x @ w1[:, 1] + b1[1]
    want = (gate / (1 + np.exp(-gate)) * up) @ w2 + b2
    np.testing.assert_allclose(np.asarray(mlp(jnp.asarray(x))), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mlp, experts", [("gelu_exact", 0), ("gelu_exact", 2), ("gelu", 0)])
def test_gelu_exact_is_megatrons_erf_gelu(mlp, experts):
    """`model.mlp: gelu_exact` is the exact (erf) GELU, Megatron-LM's GPT's; `gelu` GELU's tanh approximation,
    which differs from it by up to ~1e-3 (in the dense MLP and in MoE experts alike)."""
    from math import erf

    from jzero.train import layers
    from jzero.train.layers import MLP, MoE

    moe = MoEConfig(num_experts=experts, top_k=1, capacity_factor=None) if experts else MoEConfig()
    cfg = ModelConfig(vocab_size=64, d_model=8, n_layers=1, n_heads=2, d_ff=6, seq_len=4, mlp=mlp, bias=False, moe=moe)
    layer = (MoE if experts else MLP)(cfg, nnx.Rngs(0), jnp.float32, 0.5)
    captured = {}
    real_gelu = jax.nn.gelu

    def spy(x, approximate=True):
        captured["approximate"], captured["x"] = approximate, np.asarray(x, np.float64)
        return real_gelu(x, approximate=approximate)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 8)), jnp.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax.nn, "gelu", spy)
        mp.setattr(layers, "_recomputed", lambda f: f)  # the activation called eagerly, not traced for its recompute
        layer(x)
    assert captured["approximate"] == (mlp == "gelu")
    h = captured["x"]
    exact = 0.5 * h * (1 + np.vectorize(erf)(h / np.sqrt(2)))
    got = np.asarray(real_gelu(jnp.asarray(h, jnp.float32), approximate=mlp == "gelu"))
    np.testing.assert_allclose(got, exact, atol=1e-6 if mlp == "gelu_exact" else 1e-3)


def test_the_init_keys_are_nnx_rngs_keys_counted_in_python():
    """`layers.Keys` gives the keys `nnx.Rngs(seed).params()` gives, bit for bit, so the GPT's init is
    the one it was with nnx's counter; and under eval_shape its count is a Python int, not a tracer."""
    for seed in (0, 7):
        keys, rngs = Keys(seed), nnx.Rngs(seed)
        for _ in range(3):
            np.testing.assert_array_equal(jax.random.key_data(keys.params()), jax.random.key_data(rngs.params()))
    traced = Keys(0)
    jax.eval_shape(lambda: [traced.params() for _ in range(4)])
    assert traced.count == 4


def test_qkv_bias_is_megatrons():
    """`model.qkv_bias`: attn/qkv/bias [R + 2, G, K], split over tp with its kernel's groups; a query or value
    bias changes the logits, a key bias cannot (softmax is shift-invariant)."""
    cfg = tiny_config(model={"n_kv_heads": 2, "qkv_bias": True}).model
    model = GPTModel(cfg)
    params = model.init()
    bias = params["blocks"][0]["attn"]["qkv"]["bias"]
    r = cfg.n_heads // 2
    assert bias.shape == (r + 2, 2, cfg.d_model // cfg.n_heads)
    assert model.tp_specs(params)["blocks"][0]["attn"]["qkv"]["bias"] == P(None, "tp", None)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, cfg.seq_len + 1)), jnp.int32)
    base = model.loss_and_metrics(params, tokens)[0]

    def with_bias(part):
        value = jnp.zeros_like(bias).at[part].set(0.5)
        return jax.tree_util.tree_map_with_path(
            lambda p, x: value if jax.tree_util.keystr(p).endswith("['qkv']['bias']") else x, params
        )

    assert abs(float(model.loss_and_metrics(with_bias(r), tokens)[0] - base)) < 1e-6  # the key part
    assert abs(float(model.loss_and_metrics(with_bias(0), tokens)[0] - base)) > 1e-4  # a query head
    assert abs(float(model.loss_and_metrics(with_bias(r + 1), tokens)[0] - base)) > 1e-4  # the value


@pytest.mark.slow
def test_qkv_bias_matches_single_device_optax():
    """The QKV bias split over tp (dp 4 x tp 2, ZeRO-2): plain optax's losses, grad norms and params. Its key
    part is left out of the params: its true grad is 0, so Adam steps rounding noise to full size in both
    runs (why `model.qkv_bias` is off by default), and those steps change no output."""
    cfg = tiny_config("optim_grads", (4, 1, 2), 1, model={"n_kv_heads": 2, "qkv_bias": True})
    _, ref_losses, ref_norms, ref_params = reference_run(cfg)
    _, _, losses, norms, state = run_steps(cfg)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)
    r = cfg.model.n_heads // cfg.model.n_kv_heads
    params, ref_params = jax.device_get(state.params), jax.device_get(ref_params)
    for i in params["blocks"]:
        ours, theirs = params["blocks"][i]["attn"]["qkv"], ref_params["blocks"][i]["attn"]["qkv"]
        for qkv in (ours, theirs):  # the queries and the value, not the key
            qkv["bias"], qkv["value"] = np.asarray(qkv["bias"])[:r], np.asarray(qkv["bias"])[r + 1]
    errors = rel_param_errors(params, ref_params)
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, f"{worst}: {errors[worst]:.2e}"


@pytest.mark.parametrize(
    "choice, dtype, head_dim, backend, kernel",
    [
        ("auto", "bfloat16", 64, "gpu", "cudnn"),
        ("auto", "float16", 128, "gpu", "cudnn"),
        ("auto", "float32", 64, "gpu", "xla"),  # cuDNN's kernel takes no fp32
        ("auto", "bfloat16", 160, "gpu", "xla"),  # nor head dims over 128
        ("auto", "bfloat16", 36, "gpu", "xla"),  # nor ones off multiples of 8
        ("auto", "bfloat16", 64, "cpu", "xla"),
        ("xla", "bfloat16", 64, "gpu", "xla"),
        ("cudnn", "float32", 64, "cpu", "cudnn"),  # forced: validate and build_run refuse what cannot run
    ],
)
def test_attention_kernel_choice(choice, dtype, head_dim, backend, kernel):
    assert AttentionImpl(choice).kernel(dtype, head_dim, backend) == kernel


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.attention=cudnn"], "model.attention=cudnn needs precision.param_dtype bfloat16 or float16"),
        (
            ["model.attention=cudnn", "precision.param_dtype=bfloat16", "model.n_heads=2", "model.d_model=320"],
            "model.attention=cudnn needs a head dim .* got 160",
        ),
    ],
)
def test_forced_cudnn_attention_refuses_what_it_cannot_run(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


def test_forced_cudnn_attention_on_cpus_is_refused_when_built():
    cfg = load_config(None, ["model.attention=cudnn", "precision.param_dtype=bfloat16", "model.n_layers=1"])
    with pytest.raises(ConfigError, match="model.attention=cudnn runs on GPUs only and these devices are CPUs"):
        build_run(cfg, jax.devices()[:1])


@pytest.mark.slow
def test_bf16_embedding_grad_is_summed_in_fp32():
    """A bf16 model's token-embedding grad is each token's grads summed in fp32 and rounded once: on a batch
    of 8k tokens drawn from 40 ids it is about as close to the fp32 model's as the other bf16 grads (5.0e-3 of
    its largest, the others 1.5e-3 to 4.0e-3; summed in bf16 by the lookup's transpose it was 2.6e-2)."""
    cfg = ModelConfig(vocab_size=512, d_model=64, n_heads=8, d_ff=128, seq_len=256, n_layers=1, **LLAMA_TINY)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (32, 257)))
    model = GPTModel(cfg, jnp.bfloat16)
    params = jax.jit(model.init)()
    up = lambda p: jax.tree.map(lambda x: x.astype(jnp.float32), p)  # noqa: E731
    g16 = jax.jit(jax.grad(model.loss))(params, tokens)["tok_emb"].astype(jnp.float32)
    g32 = jax.jit(jax.grad(lambda p, t: model.loss(up(p), t)))(up(params), tokens)["tok_emb"]
    assert float(jnp.max(jnp.abs(g16 - g32)) / jnp.max(jnp.abs(g32))) < 2**-7


def test_head_and_loss_are_optaxs_to_fp32_rounding():
    """`head_logits` and `cross_entropy` (each with its own backward) give the loss of the plain einsum and
    optax's cross-entropy, and their grads, to fp32 rounding."""
    k = jax.random.split(jax.random.key(0), 3)
    x, head = jax.random.normal(k[0], (4, 6, 16)), 0.3 * jax.random.normal(k[1], (16, 50))
    labels = jax.random.randint(k[2], (4, 6), 0, 50)

    def plain(x, head):
        logits = jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    ours = jax.value_and_grad(lambda x, head: cross_entropy(head_logits(x, head), labels).mean(), (0, 1))(x, head)
    ref = jax.value_and_grad(plain, (0, 1))(x, head)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7), ours, ref)


def test_the_losss_logsumexp_is_one_pass_over_the_logits():
    """`_logsumexp` reduces the logits once (jax.nn.logsumexp: twice, the max then the sum), to fp32 rounding of
    jax.nn.logsumexp, -inf for a row of -inf (its inits combine to 0, not nan) and +inf for a row holding +inf."""
    x = 10 * jax.random.normal(jax.random.key(0), (3, 5, 1000))
    x = x.at[0, 0].set(-jnp.inf).at[1, 1, 7].set(jnp.inf)
    got, want = _logsumexp(x), jax.nn.logsumexp(x, axis=-1)
    assert float(got[0, 0]) == -np.inf and float(got[1, 1]) == np.inf
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_allclose(np.asarray(got)[finite], np.asarray(want)[finite], rtol=1e-6)
    hlo = jax.jit(_logsumexp).lower(x).as_text()
    assert hlo.count("stablehlo.reduce") == 1, hlo


def test_a_projections_weight_grad_is_made_in_the_weights_dim_order():
    """`project`'s grads are autodiff's of the einsum to fp32 rounding, and its weight grad comes out of the dot in
    the weight's dim order: no transpose after it (autodiff's transpose of "btd,dsf->btsf" makes [s, f, d] and
    transposes it, a pass XLA:GPU runs over the fp32 grad in the layer loop's backward)."""
    k = jax.random.split(jax.random.key(1), 3)
    x, w = jax.random.normal(k[0], (2, 5, 8)), jax.random.normal(k[1], (8, 2, 6))
    ct = jax.random.normal(k[2], (2, 5, 2, 6))

    def loss(f):
        return lambda x, w: jnp.sum(f("btd,dsf->btsf", x, w) * ct)

    ours, ref = (jax.grad(loss(f), (0, 1))(x, w) for f in (project, jnp.einsum))
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-6), ours, ref)
    prims = [str(e.primitive) for e in jax.make_jaxpr(jax.grad(loss(project), 1))(x, w).jaxpr.eqns]
    ref_prims = [str(e.primitive) for e in jax.make_jaxpr(jax.grad(loss(jnp.einsum), 1))(x, w).jaxpr.eqns]
    assert "transpose" in ref_prims and "transpose" not in prims, prims


def _dot_operand_dtypes(jaxpr) -> set:
    """The operand dtypes of every dot_general in a jaxpr, its sub-jaxprs (scan, remat, custom rules) included."""
    found = set()
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            found.add(tuple(str(v.aval.dtype) for v in e.invars))
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found |= _dot_operand_dtypes(inner)
    return found


@pytest.mark.parametrize("chunk", [None, 20])
def test_bf16_models_matmuls_all_take_bf16_operands(chunk):
    """In a bf16 model's grad every matmul takes bf16 operands, the LM head's two backward ones included, as
    Megatron's output layer runs under --bf16: the plain einsum's transpose kept the fp32 logits' grad and ran
    both in fp32 (TF32 on an H100, half bf16's rate; 13% of LLaMA-3.2-1B's step flops, docs/precision.md)."""
    cfg = ModelConfig(vocab_size=256, d_model=64, n_heads=8, d_ff=128, seq_len=32, n_layers=2, loss_chunk=chunk,
                      **LLAMA_TINY)  # fmt: skip
    model = GPTModel(cfg, jnp.bfloat16)
    params = jax.eval_shape(model.init)
    tokens = jax.ShapeDtypeStruct((4, 33), jnp.int32)
    assert _dot_operand_dtypes(jax.make_jaxpr(jax.grad(model.loss))(params, tokens).jaxpr) == {("bfloat16", "bfloat16")}


def test_scanned_blocks_keep_only_the_inputs_of_their_norms_and_activations(monkeypatch):
    """`layers._recomputed`: a scanned block's backward recomputes its norms and SwiGLU from their inputs instead
    of keeping their intermediates, which the scan stacks [L, ...] (on a GPU XLA copies each into and out of its
    stack; docs/precision.md): the forward scan hands its backward 17 arrays of 4.6M elements, not 30 of 6.7M,
    and the step holds 26.0 MB of temp, not 34.7 (XLA:CPU); the loss and grads are the same to fp32 rounding."""
    from jzero.train import layers

    cfg = ModelConfig(vocab_size=256, d_model=64, n_heads=8, d_ff=256, seq_len=64, n_layers=4, scan_layers=True,
                      **LLAMA_TINY)  # fmt: skip
    tokens = np.arange(8 * 65).reshape(8, 65) * 7 % 256
    kept, out, temp = {}, {}, {}
    for name in ("recomputed", "kept"):
        if name == "kept":
            monkeypatch.setattr(layers, "_recomputed", lambda f: f)
        model = GPTModel(cfg)
        params = jax.jit(model.init)()
        grad = jax.value_and_grad(model.loss)
        forward_scan = next(e for e in jax.make_jaxpr(grad)(params, tokens).jaxpr.eqns if e.primitive.name == "scan")
        kept[name] = sum(v.aval.size for v in forward_scan.outvars), len(forward_scan.outvars)
        temp[name] = jax.jit(grad).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
        out[name] = jax.device_get(jax.jit(grad)(params, tokens))
    assert kept["recomputed"][0] < 0.7 * kept["kept"][0] and kept["recomputed"][1] < kept["kept"][1]
    assert temp["recomputed"] < 0.85 * temp["kept"]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.max(np.abs(b))),
                 out["recomputed"], out["kept"])  # fmt: skip


@pytest.mark.parametrize("value, kind", [("true", "full"), ("false", "none"), ("selective", "selective")])
def test_remat_reads_megatrons_granularities_and_booleans(value, kind):
    assert load_config(None, [f"model.remat={value}"]).model.remat.value == kind


@pytest.mark.slow
def test_selective_remat_recomputes_the_attention_core_only():
    """model.remat=selective (Megatron's selective recompute) keeps the projections' and MLP's matmul outputs
    and recomputes the rest: per block the two attention matmuls (they have batch dims) run again, where full
    recompute runs every matmul again; the loss and grads are the same."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=16)
    tokens = np.arange(4 * 17).reshape(4, 17) * 7 % 64
    dots, results = {}, {}
    for remat in ("none", "selective", "full"):
        model = GPTModel(dataclasses.replace(cfg, remat=RematKind(remat)))
        params = jax.jit(model.init)()
        step = jax.jit(jax.value_and_grad(model.loss))
        dots[remat] = step.lower(params, tokens).as_text().count("stablehlo.dot_general")
        results[remat] = jax.device_get(step(params, tokens))
    assert dots["selective"] == dots["none"] + 2 * cfg.n_layers < dots["full"]
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7)
    for remat in ("selective", "full"):
        jax.tree.map(close, results[remat], results["none"])


@pytest.mark.slow
def test_chunked_loss_trains_like_plain_optax_in_a_zero_step():
    """model.loss_chunk inside the ZeRO step's shard_map (before: a scan carry typed DP-invariant, every value
    refused by JAX's type check there), a chunk that does not divide a rank's 2 x 16 tokens. The loss is the
    model's: the flat path's shard_map types it alike."""
    assert_matches_reference(tiny_config("optim_grads", (8, 1, 1), 1, model={"loss_chunk": 12}))


def test_a_loss_chunk_above_the_tokens_is_one_chunk_of_them_all():
    """model.loss_chunk of 10**8 on 16 tokens padded them to 10**8 rows: a 220 GB out-of-memory, "shard more"."""
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=4, d_ff=64, seq_len=16)
    tokens = np.arange(2 * 17).reshape(2, 17) * 7 % 256
    losses = {}
    for chunk in (None, 10**8):
        model = GPTModel(dataclasses.replace(cfg, loss_chunk=chunk))
        losses[chunk] = float(jax.jit(model.loss)(jax.jit(model.init)(), tokens))
    np.testing.assert_allclose(losses[10**8], losses[None], rtol=1e-6)


def test_chunked_loss_is_the_loss_without_the_whole_logits():
    """model.loss_chunk: the loss and grads of the whole [B, T, V] logits to fp32 rounding (a chunk that does not
    divide the tokens is padded with masked rows), and the compiled step's temp memory is less than the whole
    logits alone (XLA:CPU: 6.9 MB against 19.3 MB unchunked, the fp32 logits being 8.4 MB)."""
    cfg = ModelConfig(vocab_size=4096, d_model=32, n_layers=1, n_heads=4, d_ff=64, seq_len=64)
    tokens = np.arange(8 * 65).reshape(8, 65) * 7 % 4096
    out, temp = {}, {}
    for chunk in (None, 100):
        model = GPTModel(dataclasses.replace(cfg, loss_chunk=chunk))
        params = jax.jit(model.init)()
        step = jax.jit(jax.value_and_grad(model.loss))
        temp[chunk] = step.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
        out[chunk] = jax.device_get(step(params, tokens))
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-8)
    jax.tree.map(close, out[100], out[None])
    logits_bytes = 8 * 64 * 4096 * 4
    assert temp[None] > logits_bytes > temp[100] and temp[None] > 2 * temp[100], (temp, logits_bytes)
