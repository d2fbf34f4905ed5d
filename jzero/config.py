"""The CLI's typed run configuration, loaded: YAML plus `--set` overrides (or a checkpoint's dict) into a
validated `Config`, and back to plain values.

The config composes the library's own types (`jzero.zero.config.ZeroConfig`, `jzero.mesh.MeshConfig`,
`jzero.zero.config.ParamGroupRule`), which check themselves when built, with the harness's
sections (model, train, data, ...; `jzero.config_schema`). Every key is validated once, at load
time (`jzero.config_checks`); a bad key or value raises one `ConfigError` that names it. This
module is where the config is imported from: it also holds the schema's types and `validate`. It
starts no JAX, so the CLI can read the config (and `train.host_devices`) before JAX starts: it imports
only what the config names by import path (`jzero.imports`: a model class that declares its own keys,
an optax optimizer), which may import JAX but not start it.

A config is a YAML file, or a preset by name: `default`, `llama2_7b`, ... (`presets()`), the files of
`configs/`, which an install ships as package data (`jzero/configs`).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.resources
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from jzero.config_checks import BF16_MAX_DECAY, keyed, loss_scale, validate
from jzero.config_schema import (
    GPT_IMPL,
    MODEL_HARNESS_KEYS,
    AttentionImpl,
    AuxLossKind,
    CheckpointConfig,
    Config,
    DataConfig,
    DataKind,
    DistributedConfig,
    DropPolicy,
    DType,
    KeywordArgs,
    MlpKind,
    ModelConfig,
    MoEConfig,
    MomentsDType,
    MuonConfig,
    MuonScaleMode,
    NewtonSchulzDType,
    NormKind,
    OptaxConfig,
    OptimizerConfig,
    OptimizerName,
    PosKind,
    PrecisionConfig,
    RematKind,
    ScoreFunction,
    TokenDType,
    TrainConfig,
    yaml_key,
)
from jzero.errors import ConfigError, one_line
from jzero.imports import import_object

__all__ = [
    "BF16_MAX_DECAY",
    "GPT_IMPL",
    "MODEL_HARNESS_KEYS",
    "AttentionImpl",
    "AuxLossKind",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DType",
    "DataConfig",
    "DataKind",
    "DistributedConfig",
    "DropPolicy",
    "KeywordArgs",
    "MlpKind",
    "ModelConfig",
    "MoEConfig",
    "MomentsDType",
    "MuonConfig",
    "MuonScaleMode",
    "NewtonSchulzDType",
    "NormKind",
    "OptaxConfig",
    "OptimizerConfig",
    "OptimizerName",
    "PosKind",
    "PrecisionConfig",
    "RematKind",
    "ScoreFunction",
    "TokenDType",
    "TrainConfig",
    "from_dict",
    "load_config",
    "loss_scale",
    "presets",
    "resolve_mesh",
    "to_dict",
    "validate",
]


# The preset configs (`configs/*.yaml`): package data of an install, a link to `configs/` in a checkout.
PRESETS = importlib.resources.files("jzero") / "configs"
# A number YAML 1.1 reads as a string: an exponent without a dot (`1e-3`).
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def presets() -> list[str]:
    """The names of the preset configs, which `load_config` takes in place of a path."""
    return sorted(p.name.removesuffix(".yaml") for p in PRESETS.iterdir() if p.name.endswith(".yaml"))


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Checks and converts one YAML value to the field type `tp`."""
    origin = typing.get_origin(tp)
    if tp is KeywordArgs:  # passed through to a function as YAML typed them, but for `1e-3`, a number
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}={value!r} must be a mapping of argument names to values")
        number = lambda v: float(v) if isinstance(v, str) and _EXPONENT.fullmatch(v) else v  # noqa: E731
        return KeywordArgs({k: [number(x) for x in v] if isinstance(v, list) else number(v) for k, v in value.items()})
    if origin is tuple:  # tuple[Item, ...]: a YAML list
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list")
        item = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(item):
            return tuple(_build(item, v, f"{key}[{i}].") for i, v in enumerate(value))
        return tuple(_coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(key, inner, value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            choices = ", ".join(m.value for m in tp)
            raise ConfigError(f"{key}={value!r} is not one of: {choices}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}={value!r} must be of type {tp.__name__}")


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f.name for f in dataclasses.fields(cls) if yaml_key(f) is not None}
    unknown = sorted(set(raw) - set(fields), key=str)  # key=str: YAML may give a key that is no string (`1:`)
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]} (known: {', '.join(sorted(fields))})")
    missing = [
        key
        for key, f in ((yaml_key(f), f) for f in dataclasses.fields(cls))
        if key not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"config key {prefix}{missing[0]} is required")
    kwargs = {}
    for key_name, value in raw.items():
        name, key = fields[key_name], f"{prefix}{key_name}"
        tp = hints[name]
        if tp is ModelConfig:
            kwargs[name] = _build_model(value, f"{key}.")
        elif dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, f"{key}.")
        else:
            kwargs[name] = _coerce(key, tp, value)
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a library type checked itself: name the key as the YAML spells it
        raise keyed(prefix, e) from None


def _build_model(raw: Any, prefix: str) -> ModelConfig:
    """The `model:` section: jzero's GPT's keys (`ModelConfig`), or, for a class that declares its own
    (`config_class`, jzero.model), the harness's keys (MODEL_HARNESS_KEYS) and that class's, the latter in
    `ModelConfig.own`. A key both declare (`vocab_size`) is one value given to both, by default the class's."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix} must be a mapping, got {raw!r}")
    own_class = _own_config_class(_coerce(f"{prefix}impl", str, raw.get("impl", GPT_IMPL)))
    if own_class is None:
        return _build(ModelConfig, raw, prefix)
    own_keys = {yaml_key(f) for f in dataclasses.fields(own_class)}
    unknown = sorted(set(raw) - set(MODEL_HARNESS_KEYS) - own_keys, key=str)
    if unknown:
        known = ", ".join(sorted({*MODEL_HARNESS_KEYS, *own_keys}))
        raise ConfigError(f"unknown config key {prefix}{unknown[0]} (known: {known})")
    own = _build(own_class, {k: v for k, v in raw.items() if k in own_keys}, prefix)
    harness = {k: raw[k] if k in raw else getattr(own, k) for k in MODEL_HARNESS_KEYS if k in raw or k in own_keys}
    return dataclasses.replace(_build(ModelConfig, harness, prefix), own=own)


def _own_config_class(impl: str) -> type | None:
    """The `config_class` the model class `impl` names declares, a frozen dataclass; None for jzero's GPT
    and a class that declares none (imported only then: a class jzero cannot import is refused here)."""
    if impl == GPT_IMPL:
        return None
    cls = import_object("model.impl", impl)
    own = getattr(cls, "config_class", None)
    if own is None:
        return None
    if not (isinstance(own, type) and dataclasses.is_dataclass(own) and own.__dataclass_params__.frozen):
        raise ConfigError(
            f"model.impl={impl!r}: its config_class {own!r} must be a frozen dataclass (its own model: keys)"
        )
    return own


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names a key twice: PyYAML keeps the last one silently,
    so a config's `keep: 3` further down would undo the one a user edited."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first = {}
            for key_node, _ in node.value:  # the mapping's own keys: a merge (`<<: *defaults`) may be overridden
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, str | int | float | bool) or key is None:
                    if key in first:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key!r} appears twice (first at line {first[key] + 1})",
                            key_node.start_mark,
                        )  # fmt: skip
                    first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def _shown(text: str, limit: int = 80) -> str:
    """`text` quoted for an error line, cut to `limit` characters: a --set of 100 kB is named, not echoed."""
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _apply_override(raw: dict, assignment: str) -> None:
    """Applies one `a.b=value` override (value parsed as YAML) to the raw dict."""
    if "=" not in assignment:
        raise ConfigError(f"--set {_shown(assignment)} must look like section.key=value")
    dotted, text = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {part} is not a section")
    try:
        node[parts[-1]] = yaml.load(text, Loader=_UniqueKeys) if text.strip() else None
    except (yaml.YAMLError, ValueError) as e:  # ValueError: an integer of over 4300 digits
        problem = getattr(e, "problem", None) or one_line(e)  # str(e) spans several lines
        shown = f"--set {_shown(assignment)}: the value {_shown(text)}"
        raise ConfigError(f"{shown} is not valid YAML ({problem})") from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Loads YAML, applies `--set` overrides, validates.

    With no path the embedded default is used: the schema's defaults (`jzero.config_schema`), which
    `configs/default.yaml` spells out (a test keeps the two equal).
    """
    raw = {}
    if path is not None:
        path = _config_path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a directory, not a file")
        if not path.is_file():
            what = "is not a regular file (a FIFO, socket or device)" if path.exists() else "does not exist"
            what = "is a symbolic link to nothing (a missing target, or a loop)" if path.is_symlink() else what
            raise ConfigError(f"config file {path} {what}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path} is not UTF-8 text") from None
        except OSError as e:  # unreadable: permissions, a FIFO gone, ...
            raise ConfigError(f"config file {path} cannot be read ({e.strerror or type(e).__name__})") from None
        try:
            raw = yaml.load(text, Loader=_UniqueKeys) or {}
        except ValueError as e:  # an integer of over 4300 digits (Python's limit on int(str))
            raise ConfigError(f"config file {path} is not valid YAML: {one_line(e)}") from None
        except yaml.YAMLError as e:  # str(e) spans several lines
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]  # a ReaderError: a NUL, ...
            raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from None
        if not isinstance(raw, dict):  # before --set, which would index into it
            raise ConfigError(
                f"config file {path} must be a mapping of sections (model:, train:, ...), "
                f"not a {type(raw).__name__}: {str(raw)[:80]}"
            )
    for assignment in overrides:
        _apply_override(raw, assignment)
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def _config_path(path: str | Path):
    """`path`, or the preset it names: a name with no directory and no suffix (`llama2_7b`) that is no file here."""
    path = Path(path)
    if path.exists() or path.parent != Path(".") or path.suffix:  # a directory too: load_config names it
        return path
    preset = PRESETS / f"{path.name}.yaml"
    if not preset.is_file():
        raise ConfigError(f"config {path} is no file and no preset (presets: {', '.join(presets())})")
    return preset


def resolve_mesh(cfg: Config, n_devices: int) -> Config:
    """`cfg` with `mesh.dp=-1` filled in for `n_devices` devices, then validated again (the batch
    split depends on dp). With mesh.dp set, `cfg` itself: `make_mesh` checks it against the devices.

    Called once the device count is known (`jzero.run.build_run`, after JAX has started).
    """
    mesh = cfg.mesh.resolve(n_devices)
    if mesh == cfg.mesh:
        return cfg
    cfg = dataclasses.replace(cfg, mesh=mesh)
    validate(cfg)
    return cfg


def from_dict(raw: dict) -> Config:
    """Builds and validates a Config from a nested dict (e.g. a checkpoint's metadata)."""
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    """The config as plain YAML/JSON-able values."""

    def plain(v):
        if isinstance(v, enum.Enum):
            return v.value
        if dataclasses.is_dataclass(v):
            return {yaml_key(g): plain(getattr(v, g.name)) for g in dataclasses.fields(v) if yaml_key(g) is not None}
        if isinstance(v, tuple):
            return [dataclasses.asdict(x) if dataclasses.is_dataclass(x) else plain(x) for x in v]
        if isinstance(v, KeywordArgs):
            return {k: plain(x) for k, x in v.items()}
        return v

    out = {f.name: plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if cfg.model.own is not None:  # a model's own keys, as its section was written: from_dict reads them back
        out["model"] = {k: out["model"][k] for k in MODEL_HARNESS_KEYS} | plain(cfg.model.own)
    return out
