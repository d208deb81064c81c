"""Build a `Config` from files, command-line overrides and the environment.

Grammar (as in prime-rl): `@ a.toml @ b.yaml --model.name X --engine.enable-prefix-caching --no-x.y --seed=3`.
Layers merge in this order, later winning: environment defaults, the `@` files in order, then the
`--` overrides in order (overrides always beat files, wherever they stand on the line).
Keys may be spelled kebab-case or snake_case in any segment. In TOML, top-level keys such as `seed`
must come before the first `[section]` table, as TOML itself requires.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import tomllib
import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from rlserve.config.errors import ConfigError
from rlserve.config.schema import Config

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"null", "none"}
# Lowest-precedence defaults: the first variable that is set wins.
_ENV_DEFAULTS = {
    ("server", "api_key"): ("RLSERVE_API_KEY", "VLLM_API_KEY"),
    ("engine", "batch_invariant"): ("RLSERVE_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT"),
}
# vLLM's spellings of keys that live in a section here
_CLI_ALIASES = {"batch-invariant": "engine.batch_invariant", "batch_invariant": "engine.batch_invariant"}


def configure_logging(config: Config) -> None:
    """Every rlserve process logs at config.server.log_level, one format for all (server, engine core, workers,
    deployment supervisor)."""
    logging.basicConfig(level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def load_config(argv: list[str], base: type[Config] = Config) -> Config:
    files, overrides = _split_argv(argv)
    data: dict[str, Any] = {}
    _merge(data, _env_layer(base), base)
    for path in files:
        try:
            _merge(data, _normalize(_file_layer(path), base, [], repr, root=base), base)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    for layer in _parse_overrides(overrides, base):
        _merge(data, layer, base)
    try:
        return base.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, base)) from None


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    files, rest = [], []
    args = iter(argv)
    for arg in args:
        if arg == "@":
            path = next(args, None)
            if path is None:
                raise ConfigError("'@' must be followed by a config file path")
            files.append(path)
        elif arg.startswith("@"):
            files.append(arg[1:])
        else:
            rest.append(arg)
    return files, rest


def _parse_overrides(args: list[str], base: type[BaseModel]) -> list[dict[str, Any]]:
    layers = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: options look like --section.key VALUE, files like @ FILE")
        key, eq, raw = arg[2:].partition("=")
        names, field, negated = _resolve_cli_key(key, base, negation_ok=not eq)
        if negated:
            value = False
        elif _is_bool(field.annotation) and not eq:
            nxt = args[i + 1].lower() if i + 1 < len(args) else ""
            value = True
            if nxt in _TRUE | _FALSE:
                value, i = nxt in _TRUE, i + 1
        else:
            if not eq:
                if i + 1 >= len(args) or args[i + 1].startswith("--"):
                    raise ConfigError(f"--{key} needs a value ({_type_name(field.annotation)})")
                raw, i = args[i + 1], i + 1
            value = _parse_value(raw, field, names, base)
        layers.append(_nest(names, value))
        i += 1
    return layers


def _resolve_cli_key(key: str, base: type[BaseModel], negation_ok: bool) -> tuple[list[str], FieldInfo, bool]:
    """Field names, field, and whether the key was `no-` + a bool field."""
    key = _CLI_ALIASES.get(key, key)
    plain, rest = key.replace("-", "_").split("."), key[3:]
    negated = negation_ok and key[:3] in ("no-", "no_") and not _has_path(base, plain)
    if negated and _has_path(base, rest.replace("-", "_").split(".")):
        names, field = _resolve(base, rest.split("."), _cli_spell)
        if not _is_bool(field.annotation):
            raise ConfigError(f"--{key}: --no- only applies to true/false keys; --{'.'.join(names)} takes a value")
        return names, field, True
    return *_resolve(base, key.split("."), _cli_spell), False


def _parse_value(raw: str, field: FieldInfo, names: list[str], base: type[BaseModel]) -> Any:
    """Only what pydantic's lax parsing cannot do from a string: None and JSON containers."""
    inner, nullable = _strip_optional(field.annotation)
    if nullable and raw.lower() in _NONE:
        return None
    section = _section_model(field)
    if section is not None or (get_origin(inner) or inner) in (list, dict, tuple, set):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"--{'.'.join(names)} expects JSON ({_type_name(field.annotation)}), got {raw!r}: {e}"
            ) from None
        if section is not None and isinstance(value, dict):
            value = _normalize(value, section, names, _cli_spell, root=base)
        return value
    return raw


def _is_bool(annotation: Any) -> bool:
    return _strip_optional(annotation)[0] is bool


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ConfigError(f"unknown extension {suffix!r}; use .toml, .yaml, .yml or .json")
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file: {e.strerror or e}") from None
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot parse config file: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"a config file must hold a mapping of keys, not {type(data).__name__}")
    return data


def _file_layer(path: str) -> dict[str, Any]:
    from rlserve.config.dialects.prime_rl import from_prime_rl  # prime-rl's layouts and names, as rlserve's

    return from_prime_rl(_read_file(path))


def _env_layer(base: type[BaseModel]) -> dict[str, Any]:
    layer: dict[str, Any] = {}
    for names, variables in _ENV_DEFAULTS.items():
        value = next((os.environ[v] for v in variables if os.environ.get(v)), None)
        if value is not None and _has_path(base, list(names)):
            _merge(layer, _nest(list(names), value), base)
    return layer


Spell = Callable[[str], str]  # how a dotted key is shown in messages


def _cli_spell(dotted: str) -> str:
    return f"--{dotted}"


def _resolve(root: type[BaseModel], segments: list[str], spell: Spell) -> tuple[list[str], FieldInfo]:
    model: type[BaseModel] | None = root
    names: list[str] = []
    for segment in segments:
        name = segment.replace("-", "_")
        if model is None or name not in model.model_fields:
            _unknown(".".join(names + [segment]), spell, root)
        names.append(name)
        field = model.model_fields[name]
        model = _section_model(field)
    return names, field


def _normalize(
    data: dict[str, Any], model: type[BaseModel], prefix: list[str], spell: Spell, root: type[BaseModel]
) -> dict[str, Any]:
    """Check every key against the model and spell it as the field name."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in model.model_fields:
            _unknown(".".join(prefix + [str(key)]), spell, root)
        section = _section_model(model.model_fields[name])
        if section is not None and isinstance(value, dict):
            value = _normalize(value, section, prefix + [name], spell, root)
        out[name] = value
    return out


def _unknown(dotted: str, spell: Spell, root: type[BaseModel]) -> None:
    raise ConfigError(f"unknown key {spell(dotted)}{_suggest(dotted, spell, root)}")


def _suggest(dotted: str, spell: Spell, root: type[BaseModel]) -> str:
    paths = [p for p, _ in _walk(root)]
    dotted = dotted.replace("-", "_")
    leaf = dotted.rsplit(".", 1)[-1]
    if "." in dotted and leaf in root.model_fields:  # TOML puts keys after a [table] header into that table
        return f"; did you mean {spell(leaf)}? (in TOML, top-level keys go above the first [section])"
    match = difflib.get_close_matches(dotted, paths, n=1, cutoff=0.6)
    if not match:  # e.g. --max-model-len for --model.max_model_len
        match = [p for p in paths if difflib.get_close_matches(leaf, [p.rsplit(".", 1)[-1]], cutoff=0.8)][:1]
    return f"; did you mean {spell(match[0])}?" if match else ""


def _merge(dst: dict[str, Any], src: dict[str, Any], model: type[BaseModel] | None) -> None:
    """Deep-merge through sections only; a field's value (even a dict) is replaced whole."""
    for key, value in src.items():
        section = _section_model(model.model_fields[key]) if model and key in model.model_fields else None
        if section is not None and isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value, section)
        else:
            dst[key] = value


def _nest(names: list[str], value: Any) -> dict[str, Any]:
    for name in reversed(names):
        value = {name: value}
    return value


def _has_path(model: type[BaseModel] | None, names: list[str]) -> bool:
    for name in names:
        if model is None or name not in model.model_fields:
            return False
        model = _section_model(model.model_fields[name])
    return True


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(get_args(annotation))
        return (args[0] if len(args) == 1 else Union[tuple(args)]), nullable  # noqa: UP007 (built at run time)
    return annotation, False


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    inner = _strip_optional(field.annotation)[0]
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return "{" + ",".join(str(a) for a in get_args(annotation)) + "}"
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(annotation))
    if annotation is type(None):
        return "none"
    if origin is not None:
        return str(annotation).replace("typing.", "")
    return getattr(annotation, "__name__", str(annotation))


def _walk(model: type[BaseModel], prefix: str = ""):
    """(dotted path, field) for every field, sections included, depth first."""
    for name, field in model.model_fields.items():
        path = prefix + name
        yield path, field
        section = _section_model(field)
        if section is not None:
            yield from _walk(section, path + ".")


def _describe(error: ValidationError, base: type[BaseModel]) -> str:
    lines = []
    for e in error.errors(include_url=False):
        # Keep the loc entries that are field names; pydantic appends union tags like 'int'.
        names = [str(part) for part in e["loc"]]
        while names and not _has_path(base, names):
            names.pop()
        msg = e["msg"].removeprefix("Value error, ")
        if not names:
            lines.append(f"invalid config: {msg}")
            continue
        dotted = ".".join(names)
        line = f"invalid value for {dotted}: {msg} (got {e['input']!r})"
        lines.append(line + f"; set {dotted} in the config file or pass --{dotted} VALUE")
    return "\n".join(dict.fromkeys(lines))


def _show_default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def help_text(base: type[Config] = Config) -> str:
    groups: dict[str, list[tuple[str, str, str, str]]] = {}
    for path, field in _walk(base):
        if _section_model(field) is not None:
            continue
        section = path.rpartition(".")[0] or "general"
        row = (f"--{path}", _type_name(field.annotation), f"(default: {_show_default(field)})", field.description or "")
        groups.setdefault(section, []).append(row)
    widths = [max(len(row[i]) for rows in groups.values() for row in rows) for i in range(3)]
    lines = [
        "Config: @ FILE (.toml/.yaml/.json, merged in order), then --section.key VALUE overrides (later wins).",
        "Keys take kebab-case or snake_case; booleans --flag / --no-flag; none/null clears; lists and dicts take JSON.",
        "RLSERVE_API_KEY or VLLM_API_KEY set server.api_key when nothing else does.",
    ]
    for section, rows in groups.items():
        lines.append(f"\n{section}:")
        for row in rows:
            lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
    return "\n".join(line.rstrip() for line in lines) + "\n"
