"""Other servers' launch lines and config files, translated into rlserve's own config tree.

Each dialect is a table of its flags (or keys) and the rlserve key each one sets; the result is the
native `--section.key VALUE` list (or config mapping) that `config_loader` reads, so there is one way in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlserve.config.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Flag:
    """`target`: the rlserve key it sets (None: accepted and ignored, `note` says why). A switch takes no
    value and sets `const`; otherwise the value (after `convert`) is passed on."""

    target: str | None
    switch: bool = False
    const: str = "true"
    convert: Callable[[str], str] | None = None
    note: str = ""


def _dashed(name: str, *tables: dict) -> str:
    """vLLM reads `--max_model_len` as `--max-model-len`; rlserve's own top-level keys keep their underscores."""
    from rlserve.config.schema import Config

    if not name.startswith("--") or "_" not in name or name[2:] in Config.model_fields:
        return name
    dashed = name.replace("_", "-")
    return dashed if any(dashed in table for table in tables) else name


def translate_launch_line(argv: list[str]) -> list[str]:
    """vLLM's and the MLX RL server's flags (positional model included) as rlserve's own; others pass through."""
    from rlserve.config.dialects.mlx_flags import MLX_FLAGS, MLX_ONLY
    from rlserve.config.dialects.vllm_flags import DATA_PARALLEL, REFUSED, VLLM_FLAGS, data_parallel_settings

    flags = VLLM_FLAGS | MLX_FLAGS | dict.fromkeys(DATA_PARALLEL, Flag(None))  # those read together at the end
    out: list[str] = []
    i = 0
    if argv and not argv[0].startswith(("-", "@")):  # `vllm serve MODEL ...`
        if argv[0].endswith((".toml", ".yaml", ".yml", ".json")):
            raise ConfigError(f"{argv[0]!r} looks like a config file, not a model: pass it as @ {argv[0]}")
        out += ["--model.name", argv[0]]
        i = 1
    seen: set[str] = set()
    data_parallel: dict[str, str] = {}
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        name = _dashed(name, flags, REFUSED)
        flag = flags.get(name) if arg.startswith("-") else None
        if name in REFUSED:
            raise ConfigError(f"{name}: {REFUSED[name]}")
        value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
        if flag is None or (name == "--model" and value is not None and value.lstrip().startswith("{")):
            out.append(arg)  # rlserve's own grammar (--model '{json}' included)
            i += 1
            continue
        seen.add(name)
        if flag.switch:
            i += 1
            if eq:
                raise ConfigError(f"{name} is a switch; pass it without a value")
            if flag.target is not None:
                out += [f"--{flag.target}", flag.const]
            continue
        if value is None or (not eq and value.startswith("--")):
            raise ConfigError(f"{name} needs a value")
        i += 1 if eq else 2
        if name == "--served-model-name":  # vLLM takes several names; rlserve serves one
            extra = []
            while not eq and i < len(argv) and not argv[i].startswith("-"):
                extra.append(argv[i])
                i += 1
            if extra:
                raise ConfigError(f"--served-model-name: rlserve serves one name, got {[value, *extra]}")
        value = flag.convert(value) if flag.convert else value  # checks even what is then ignored
        if name in DATA_PARALLEL:
            data_parallel[DATA_PARALLEL[name]] = value
        if flag.target is not None:
            out += [f"--{flag.target}", value]
    for key, value in data_parallel_settings(data_parallel).items():
        out += [f"--{key}", value]
    if seen & MLX_ONLY and "--metrics-format" not in seen:
        out += ["--server.metrics_format", "json"]  # the MLX server's clients read /metrics as JSON
    return out
