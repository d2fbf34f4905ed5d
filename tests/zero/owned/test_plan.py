"""Whole-tensor ownership (`jzero/zero/owned/plan.py`): every piece owned once, balanced, deterministic;
Megatron-Core 0.16.1's ping-pong deal reproduced on its own fixture."""

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from helpers import megatron_fixtures as mf
from helpers import pytree
from jzero.errors import ConfigError
from jzero.zero.common.strategies import make_plan
from jzero.zero.owned.plan import OwnedBalance, describe, make_owned_plan


def _plan(abstract, dp, units=None, tp=1, specs=None):
    mesh = pytree.mesh(dp, tp)
    specs = specs or jax.tree.map(lambda _: P(), abstract)
    return make_plan(mesh, "optim", abstract, specs, units=units)


def _names(plan):
    return [t.name for t in jax.tree.leaves(plan.tensors)]


def test_megatron_balance_reproduces_megatron_ownership():
    """Megatron's fixture (dp 4): which rank owns which param, and the all-gather sizes per rank."""
    layout = json.loads((mf.DATA / "muon" / "muon_dp4" / "layout.json").read_text())
    abstract = jax.eval_shape(mf.init_params)
    plan = _plan(abstract, 4)
    owned = make_owned_plan(plan, OwnedBalance.MEGATRON)
    megatron_name = dict(zip(_names(plan), jax.tree.leaves(mf.NAMES)))
    dom = owned.domains[0]
    for r in range(4):
        mine = sorted(megatron_name[_names(plan)[p.leaf]] for p in dom.owned(r))
        assert mine == sorted(x["name"] for x in layout["owned_per_rank"][str(r)])
        assert dom.loads()[r] == layout["all_gather_numel_per_rank"][str(r)]


@pytest.mark.parametrize("dp", [2, 3, 8])
def test_elements_balance_owns_every_layer_once(dp):
    abstract = {
        "blocks": jax.ShapeDtypeStruct((6, 8, 4), jnp.float32),
        "emb": jax.ShapeDtypeStruct((20, 4), jnp.float32),
        "norm": jax.ShapeDtypeStruct((4,), jnp.float32),
    }
    plan = _plan(abstract, dp, units={"blocks": 1, "emb": None, "norm": None})
    owned = make_owned_plan(plan)
    (dom,) = owned.domains
    pieces = {(p.leaf, p.layer) for p in dom.pieces}
    assert len(pieces) == len(dom.pieces) == 6 + 1 + 1  # the stack by layer, the others whole
    loads = dom.loads()
    assert dom.size == max(loads) and sum(loads) == 6 * 32 + 80 + 4
    assert max(loads) - min(loads) <= max(p.numel for p in dom.pieces)  # the greedy rule's bound
    for r in range(dp):  # each owner's pieces contiguous from 0, in (leaf, layer) order
        offsets = [(p.offset, p.numel) for p in dom.owned(r)]
        assert [o for o, _ in offsets] == [sum(n for _, n in offsets[:i]) for i in range(len(offsets))]
    assert make_owned_plan(plan) == owned  # deterministic


def test_more_ranks_than_pieces_leaves_ranks_empty():
    plan = _plan({"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}, 4)
    owned = make_owned_plan(plan)
    assert owned.domains[0].loads() == [16, 0, 0, 0]
    lines = describe(owned, _names(plan))
    assert "rank 3: 0 elements: (nothing)" in "\n".join(lines)


def test_refuses_params_split_over_tp():
    with pytest.raises(ConfigError, match="split over tp"):
        make_owned_plan(_plan(pytree.abstract(), 2, tp=2, specs=pytree.TP_SPECS))
