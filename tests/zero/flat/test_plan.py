"""jzero.zero.flat.plan: the flat-buffer view of a ShardingPlan: Megatron's layout over the local params,
one buffer per group (the whole model's, or each FSDP unit's and the rest's; a scanned stack's laid out per
layer), and what the flat path refuses. The per-device operations on it: tests/zero/flat/test_local.py."""

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from helpers import flat_config, pytree
from jzero.errors import ConfigError
from jzero.mesh import DENSE_DP_AXES as DP
from jzero.train.loop import setup
from jzero.zero.common.strategies import make_plan
from jzero.zero.config import ShardingStrategy
from jzero.zero.flat.buffers import build_layout
from jzero.zero.flat.plan import REST, make_flat_plan, unit_key

LEAVES = ["bias", "s", "v", "w"]  # jax's order of the model's dict
SCAN = {"scan_layers": True, "remat": True}
MOE = {"moe": {"num_experts": 4, "top_k": 2, "every": 2, "capacity_factor": 1.0}}


def flat_plan(dp=4, tp=1, strategy=ShardingStrategy.OPTIM, bucket_size=None, abstract=None):
    specs = pytree.TP_SPECS if tp > 1 else pytree.NO_TP
    plan = make_plan(pytree.mesh(dp, tp), strategy, abstract or pytree.abstract(), specs)
    return make_flat_plan(plan, bucket_size, False)


def test_one_dense_buffer_of_the_tp_local_params():
    fp = flat_plan(dp=2, tp=2)
    (buf,) = fp.buffers
    assert (buf.kind, buf.params, buf.d, buf.sharded, buf.model_axes) == ("dense", (0, 1, 2, 3), 2, True, ("tp",))
    assert fp.local_shapes == ((3,), (3, 8, 5), (3, 12), (16, 3))  # bias, s, v, w: tp halves all but s
    assert fp.tp_sharded == (True, False, True, True)
    assert [end - start for start, end, _ in buf.layout.param_index_map] == [3, 120, 36, 48]
    assert buf.layout.numel % math.lcm(2, 128) == 0
    assert fp.bucket_shapes() == [(2, buf.layout.numel)] and fp.bucket_specs() == [P("tp", DP)]
    assert fp.shard_size(0) == buf.layout.numel // 2
    ddp = flat_plan(dp=2, tp=2, strategy=ShardingStrategy.NO_SHARD)
    assert ddp.shard_size(0) == ddp.buffers[0].layout.numel and ddp.bucket_specs() == [P("tp", None)]


def test_the_flat_path_needs_one_param_dtype():
    mixed = pytree.abstract() | {"bias": jax.ShapeDtypeStruct((6,), jnp.bfloat16)}
    with pytest.raises(ConfigError, match=r"^zero.path=flat needs one param dtype \(one buffer\); got"):
        flat_plan(abstract=mixed)


def test_without_a_bucket_size_each_buffer_is_one_bucket_under_zero3_per_unit_too():
    """Megatron-FSDP's one bucket per unit: a scanned stack's buffer is one [L, S] bucket array."""
    run = setup(flat_config("optim_grads_params", (4, 1, 2), model=SCAN), with_data=False)
    fp = run.zero.flat
    assert [g.key for g in fp.groups if g.layers is not None] and all(
        buf.n_buckets == 1 for g in fp.groups for buf in g.buffers
    )
    assert len(fp.bucket_shapes()) == sum(len(g.buffers) for g in fp.groups)


# ---------------------------------------------------------------- per FSDP unit


@pytest.mark.parametrize("model", [{}, SCAN, MOE], ids=["unrolled", "scanned", "moe"])
def test_each_unit_is_laid_out_as_megatron_lays_out_its_params(model):
    """One group per block (a scanned stack: one group, laid out per layer) and one of the rest; each
    group's buffer is `build_layout` of its params' local element counts, with the bucket size applied
    within the group; together the groups hold every param once."""
    mesh = (2, 2, 2) if "moe" in model else (4, 1, 2)
    run = setup(flat_config("optim_grads", mesh, model=model, bucket_size=3000), with_data=False)
    fp, tensors = run.zero.flat, jax.tree.leaves(run.zero.plan.tensors)
    n_layers = run.cfg.model.n_layers
    units = [g.key for g in fp.groups if g.key != REST]
    assert units == (["blocks"] if model.get("scan_layers") else [f"blocks/{i}" for i in range(n_layers)])
    assert sorted(i for g in fp.groups for i in g.params) == list(range(len(tensors)))
    for g in fp.groups:
        assert all(tensors[i].unit_dims is not None for i in g.params) == (g.key != REST)
        assert g.layers == (n_layers if g.key == "blocks" else None)
        for buf in g.buffers:
            numels = [math.prod(fp.layer_shape(i)) for i in buf.params]
            assert buf.layout == build_layout(numels, buf.layout.dp_size, 3000)
            assert set(buf.params) <= set(g.params) and buf.lead == ((g.layers,) if g.layers else ())
    kinds = {buf.kind for g in fp.groups if g.key != REST for buf in g.buffers}
    assert kinds == ({"dense", "expert"} if "moe" in model else {"dense"})


def test_a_scanned_stacks_buckets_are_stacked_per_layer():
    """[L, tp, S_b] buckets split over DP on S_b; the optimizer state as [L, tp, S_b] too; the model params,
    resting as bucket shards (ZeRO-2's overlap_param_gather), split over the inner DP axes."""
    run = setup(flat_config("optim_grads", (4, 1, 2), model=SCAN, bucket_size=3000), with_data=False)
    fp, z = run.zero.flat, run.zero
    stacked = [(buf, b) for buf, b in fp.buckets if buf.layers]
    assert len(stacked) > 1 and fp.plan.stage.params_rest_sharded
    dp = ("dp_outer", "dp", "ep")
    for k, (buf, b) in enumerate(fp.buckets):
        want = (*buf.lead, 2, buf.numel(b))
        assert fp.bucket_shapes()[k] == want and fp.shard_shape(k) == (*buf.lead, buf.numel(b) // 4)
        assert fp.bucket_specs()[k] == (P(None, "tp", dp) if buf.layers else P("tp", dp))
        assert z.shardings.params[k].spec == fp.bucket_specs()[k]  # inner axes = every DP axis here
    state = jax.eval_shape(run.init_state)
    assert [x.shape for x in state.params] == fp.bucket_shapes()
    moments = jax.tree_util.tree_flatten_with_path(state.opt_state.inner_state)[0]
    assert {x.shape == fp.bucket_shapes()[path[-1].idx] for path, x in moments if x.ndim} == {True}


def test_unit_key_names_one_unit_per_block_of_a_list_a_stack_and_flax_trees():
    """A unit param's unit: up to its first integer key (jzero's GPT, NNX's `nnx.List` as a pure dict), else up
    to its first key Linen numbered (a list attribute's `blocks_3`, a compact module's `Block_3`), else its first
    key (a scanned stack); Linen's leading `params` never names a unit alone."""

    def key(*names):
        return unit_key(tuple(jax.tree_util.DictKey(n) for n in names))

    assert key("blocks", 3, "attn", "qkv", "kernel") == "blocks/3"  # GPT; NNX's {"blocks": {3: ...}}
    in_a_list = (jax.tree_util.DictKey("blocks"), jax.tree_util.SequenceKey(1), jax.tree_util.DictKey("w"))
    assert unit_key(in_a_list) == "blocks/1"
    assert key("blocks", "mlp", "fc1", "kernel") == "blocks"  # a scanned stack [L, ...]
    assert key("stage_0", "blocks", 2, "w") == "stage_0/blocks/2"  # an integer key first
    assert key("params", "blocks_3", "attn", "out", "kernel") == "params/blocks_3"
    assert key("params", "Block_3", "Dense_0", "kernel") == "params/Block_3"
    assert key("params", "decoder", "layers_1", "mlp", "kernel") == "params/decoder/layers_1"
    assert key("params", "blocks", "fc1", "kernel") == "params/blocks"  # nn.scan's stack
    assert key("enc", "a", "w") == "enc"  # blocks under string keys need unit_key= (tests/zero/test_fsdp.py)
