"""jzero's GPT (`jzero.train.model`) under Megatron's names: `GPTModel` with its local layer spec.

Megatron's state dict, in registration order (the order of its distributed optimizer's buffer), and
the jzero param each key holds (torch's Linear stores `[out, in]` and computes `x @ W.T`):

  embedding.word_embeddings.weight [V, D]        tok_emb [V, D]
  embedding.position_embeddings.weight [T, D]    pos_emb [T, D]          (model.pos: learned)
  decoder.layers.<i>.                            blocks/<i>/ (scan_layers: blocks/...[i])
    input_layernorm.weight, .bias [D]            ln1/scale, ln1/bias     (rmsnorm: weight only)
    self_attention.linear_proj.weight [D, H*K]   attn/proj/kernel [H, K, D], transposed
    self_attention.linear_proj.bias [D]          attn/proj/bias
    self_attention.linear_qkv.weight             attn/qkv/kernel [D, R + 2, G, K]: Megatron's rows are
      [G * (R + 2) * K, D]                         per query group g its R query heads, then its key and
                                                   value, K rows each: row (g * (R + 2) + s) * K + k
    self_attention.linear_qkv.bias               attn/qkv/bias [R + 2, G, K] with model.qkv_bias, as the
      [G * (R + 2) * K]                            kernel's rows; none without it
    pre_mlp_layernorm.weight, .bias [D]          ln2/scale, ln2/bias
    mlp.linear_fc1.weight [F, D] or [2F, D]      mlp/fc1/kernel [D, F], or swiglu's [D, 2, F] (gate rows
                                                   first, then up: Megatron's glu chunks them so)
    mlp.linear_fc1.bias [F] or [2F]              mlp/fc1/bias [F] or [2, F]
    mlp.linear_fc2.weight [D, F], .bias [D]      mlp/fc2/kernel [F, D] transposed, mlp/fc2/bias
    a MoE block's MLP (`model.moe`; Megatron's softmax router with moe_router_pre_softmax, SequentialMLP):
    mlp.router.weight [E, D]                     mlp/router/kernel [D, E] transposed
    mlp.experts.local_experts.<e>.linear_fc1.*   mlp/experts/fc1/{kernel,bias}[e], as the dense fc1
    mlp.experts.local_experts.<e>.linear_fc2.*   mlp/experts/fc2/{kernel,bias}[e], as the dense fc2
      (e the global expert: a checkpoint's expert-parallel ranks are joined when read)
  decoder.final_layernorm.weight, .bias [D]      ln_f/scale, ln_f/bias
  output_layer.weight [V, D]                     head [D, V] transposed  (untied embeddings only)

plus `<module>._extra_state` (None) after each Linear (linear_proj, linear_qkv, linear_fc1, linear_fc2,
output_layer), which Megatron's strict load expects. Where Megatron has a param jzero's model has
not (the QKV bias under `--add-bias-linear` without `model.qkv_bias`, a LayerNorm bias for a bias-free
jzero model), the export writes zeros, the same function, and the import refuses a nonzero one. Every conversion is a
reshape or transpose: exact both ways, for the params and the optimizer's moments alike.

A names file (`read_names_file`) is a JSON object of the same mapping for Megatron models named
otherwise: Megatron key -> jzero param path (`blocks/0/attn/qkv/kernel`, `blocks/attn/qkv/kernel[0]` for
a layer of a scanned stack, `blocks/0/mlp/experts/fc1/kernel[3]` for an expert, or both) or null, in
Megatron's registration order; `megatron_names` writes the default one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jzero.config import ModelConfig, NormKind, PosKind
from jzero.interop import InteropError
from jzero.interop.megatron_format import EXTRA_STATE
from jzero.interop.megatron_names import Renamed
from jzero.paths import not_a_file
from jzero.train.layers import is_moe_block

PyTree = Any


def megatron_names(cfg: ModelConfig) -> dict[str, str | None]:
    """Megatron GPTModel's (local spec) state-dict keys for `cfg`, in registration order, each to the
    jzero param it holds, or None (module docstring)."""
    o = cfg.moe
    if o.num_experts and (o.expert_bias or o.score_function.value != "softmax"):
        raise InteropError(
            "model.moe: jzero moves MoE GPTs with Megatron's softmax router (moe_router_pre_softmax) only, without "
            "an expert bias"
        )
    layernorm = cfg.norm == NormKind.LAYERNORM
    out: dict[str, str | None] = {"embedding.word_embeddings.weight": "tok_emb"}
    if cfg.pos == PosKind.LEARNED:
        out["embedding.position_embeddings.weight"] = "pos_emb"

    def norm(megatron: str, jzero: str) -> None:
        out[f"{megatron}.weight"] = f"{jzero}/scale"
        if layernorm:  # Megatron's LayerNorm always has a bias
            out[f"{megatron}.bias"] = f"{jzero}/bias" if cfg.bias else None

    def linear(megatron: str, jzero: str, bias: str | None | bool) -> None:
        out[f"{megatron}.weight"] = f"{jzero}/kernel"
        if bias is not False:
            out[f"{megatron}.bias"] = bias
        out[f"{megatron}.{EXTRA_STATE}"] = None

    for i in range(cfg.n_layers):
        m, j = f"decoder.layers.{i}", "blocks/" if cfg.scan_layers else f"blocks/{i}/"
        at = f"[{i}]" if cfg.scan_layers else ""
        start = len(out)
        norm(f"{m}.input_layernorm", f"{j}ln1")
        linear(f"{m}.self_attention.linear_proj", f"{j}attn/proj", f"{j}attn/proj/bias" if cfg.bias else False)
        qkv_bias = f"{j}attn/qkv/bias" if cfg.qkv_bias else None if cfg.bias else False
        linear(f"{m}.self_attention.linear_qkv", f"{j}attn/qkv", qkv_bias)
        norm(f"{m}.pre_mlp_layernorm", f"{j}ln2")
        if is_moe_block(cfg, i):  # the router, then each expert's fc1 and fc2: jzero stacks them [E, ...]
            out[f"{m}.mlp.router.weight"] = f"{j}mlp/router/kernel{at}"
            for e in range(o.num_experts):
                for fc in ("fc1", "fc2"):
                    x, key = f"{j}mlp/experts/{fc}", f"{m}.mlp.experts.local_experts.{e}.linear_{fc}"
                    out[f"{key}.weight"] = f"{x}/kernel{at}[{e}]"
                    if cfg.bias:
                        out[f"{key}.bias"] = f"{x}/bias{at}[{e}]"
                    out[f"{key}.{EXTRA_STATE}"] = None
        else:
            linear(f"{m}.mlp.linear_fc1", f"{j}mlp/fc1", f"{j}mlp/fc1/bias" if cfg.bias else False)
            linear(f"{m}.mlp.linear_fc2", f"{j}mlp/fc2", f"{j}mlp/fc2/bias" if cfg.bias else False)
        if at:
            for key in list(out)[start:]:
                if out[key] is not None and not out[key].endswith("]"):  # experts' have theirs already
                    out[key] = out[key] + at
    norm("decoder.final_layernorm", "ln_f")
    if not cfg.tie_embeddings:
        out["output_layer.weight"] = "head"
    out[f"output_layer.{EXTRA_STATE}"] = None
    return out


def read_names_file(path: str | Path) -> dict[str, str | None]:
    """A names file (module docstring), checked to be a JSON object of strings or nulls."""
    if not_a_file(path):  # a FIFO would block the read forever
        raise InteropError(f"names file {path} is not a regular file")
    try:
        names = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InteropError(f"names file {path} is unreadable: {e}") from None
    if not isinstance(names, dict) or not all(isinstance(v, (str, type(None))) for v in names.values()):
        raise InteropError(f"names file {path} must be a JSON object of Megatron name -> jzero param path or null")
    return names


# ---------------------------------------------------------------- conversions of one layer's array


def _qkv(shape) -> tuple[Callable, Callable]:
    d, s, g, k = shape  # [D, R + 2, G, K] -> rows (g, s, k)
    return (lambda x: x.transpose(2, 1, 3, 0).reshape(g * s * k, d),
            lambda w: w.reshape(g, s, k, d).transpose(3, 1, 0, 2))  # fmt: skip


def _qkv_bias(shape) -> tuple[Callable, Callable]:
    s, g, k = shape  # [R + 2, G, K] -> [G * (R + 2) * K], as the kernel's rows
    return lambda x: x.transpose(1, 0, 2).reshape(-1), lambda w: w.reshape(g, s, k).transpose(1, 0, 2)


def _proj(shape) -> tuple[Callable, Callable]:
    h, k, d = shape  # [H, K, D] -> [D, H * K]
    return lambda x: x.reshape(h * k, d).T, lambda w: w.T.reshape(h, k, d)


def _fc1(shape) -> tuple[Callable, Callable]:
    if len(shape) == 2:  # [D, F] -> [F, D]
        return lambda x: x.T, lambda w: w.T
    d, two, f = shape  # swiglu [D, 2, F] -> [2F, D]: gate rows, then up rows
    return lambda x: x.transpose(1, 2, 0).reshape(two * f, d), lambda w: w.reshape(two, f, d).transpose(2, 0, 1)


def _flat(shape) -> tuple[Callable, Callable]:
    return lambda x: x.reshape(-1), lambda w: w.reshape(shape)


def _transpose(shape) -> tuple[Callable, Callable]:
    return lambda x: x.T, lambda w: w.T


def _same(shape) -> tuple[Callable, Callable]:
    return lambda x: x, lambda w: w


_ROLES = (  # jzero path suffix -> conversion of one layer's array (by its jzero shape)
    (r"attn/qkv/kernel$", _qkv),
    (r"attn/qkv/bias$", _qkv_bias),
    (r"attn/proj/kernel$", _proj),
    (r"mlp/fc1/kernel$", _fc1),
    (r"mlp/fc1/bias$", _flat),
    (r"mlp/fc2/kernel$", _transpose),
    (r"(^|/)head$", _transpose),
    (r"mlp/router/kernel$", _transpose),  # [D, E] from [E, D]
    (r"mlp/experts/fc1/kernel$", _fc1),  # one expert's
    (r"mlp/experts/fc1/bias$", _flat),
    (r"mlp/experts/fc2/kernel$", _transpose),
)


def _role(path: str) -> Callable:
    return next((role for pattern, role in _ROLES if re.search(pattern, path)), _same)


def _zeros_like_bias(weight: np.ndarray) -> np.ndarray:
    """A zero bias for a Megatron weight: one per output row ([out, in]), or per element (1-D)."""
    return np.zeros(weight.shape[:1], weight.dtype)


def _path_name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def gpt_names(abstract_params: PyTree, names: dict[str, str | None]) -> tuple[PyTree, list[str]]:
    """(`names` for `jzero.interop.megatron.load/save`: a tree of `Renamed` shaped like the params,
    the Megatron state-dict keys in registration order) for jzero's GPT params `abstract_params` and a
    mapping Megatron key -> jzero path or None (`megatron_names`, `read_names_file`)."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    shapes = {_path_name(p): tuple(x.shape) for p, x in leaves}
    # jzero path -> {index: Megatron key}; the index () names the whole param, (i,) the layer i of a scanned
    # stack or the expert i of a MoE block's [E, ...] experts, (i, e) both
    mapped: dict[str, dict[tuple[int, ...], str]] = {}
    for key, target in names.items():
        if target is None:
            continue
        m = re.fullmatch(r"(.*?)((?:\[\d+\])*)", target)
        path, index = m[1], tuple(int(i) for i in re.findall(r"\d+", m[2]))
        if path not in shapes:
            raise InteropError(f"names: {key} -> {target}, which is not a param of the model ({len(shapes)} params)")
        if index in mapped.setdefault(path, {}):
            raise InteropError(f"names: {target} is given twice ({mapped[path][index]}, {key})")
        mapped[path][index] = key
    by_key = {k: (path, index) for path, indices in mapped.items() for index, k in indices.items()}
    extras: dict[str, list[str]] = {}  # Megatron key of a weight -> its zero params (same module)
    for key, target in names.items():
        if target is None and not key.endswith(EXTRA_STATE):
            module = key.rsplit(".", 1)[0]
            owner = next((k for k in by_key if k.rsplit(".", 1)[0] == module), None)
            if owner is None:
                raise InteropError(f"names: {key} maps to nothing and its module has no param jzero's model has")
            extras.setdefault(owner, []).append(key)

    def renamed(path: str) -> Renamed:
        indices = mapped.get(path)
        if indices is None:
            raise InteropError(f"names: the model's param {path} has no Megatron name")
        shape = shapes[path]
        depths = {len(i) for i in indices}
        if len(depths) > 1:
            raise InteropError(f"names: {path} is named both whole and per layer or expert")
        depth = next(iter(depths))
        order = sorted(indices)
        if depth > len(shape) or order != sorted(np.ndindex(*shape[:depth])):
            raise InteropError(
                f"names: {path} {list(shape)} is named for {'layers' if depth == 1 else 'indices'} "
                f"{sorted(indices)[:8]}"
            )
        to, back = _role(path)(shape[depth:])
        keys = tuple(k for i in order for k in (indices[i], *extras.get(indices[i], ())))

        def to_megatron(x):
            out = []
            for i in order:
                w = to(x[i])
                out += [w, *(_zeros_like_bias(w) for _ in extras.get(indices[i], ()))]
            return tuple(out)

        def from_megatron(arrays):
            got = dict(zip(keys, arrays))
            for i in order:
                for extra in extras.get(indices[i], ()):
                    if np.any(got[extra] != 0):
                        raise InteropError(
                            f"Megatron's {extra} is not zero, and jzero's model has no such param (a QKV bias: "
                            "set model.qkv_bias=true; a LayerNorm bias: jzero's model.bias)"
                        )
            parts = [back(got[indices[i]]) for i in order]
            return parts[0] if not depth else np.stack(parts).reshape(*shape[:depth], *parts[0].shape)

        return Renamed(keys, to_megatron, from_megatron)

    tree = jax.tree_util.tree_map_with_path(lambda p, _: renamed(_path_name(p)), abstract_params)
    unknown = sorted(set(by_key) - {k for r in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Renamed))
                                    for k in r.names})  # fmt: skip
    if unknown:
        raise InteropError(f"names: {unknown[0]} maps to no param of the model")
    return tree, list(names)
