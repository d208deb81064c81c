"""Config loading: files, CLI overrides, errors a user sees, help, env vars, the CLI entry."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from rlserve.cli import inference_main, main
from rlserve.config.load import ConfigError, help_text, load_config
from rlserve.config.schema import Config, Section

SRC = Path(__file__).resolve().parents[1] / "src"

TOML = """
seed = 7
[model]
name = "/models/tiny"
max-model-len = 1024
[engine]
enable_prefix_caching = false
"""
YAML = """
seed: 7
model:
  name: /models/tiny
  max_model_len: 1024
engine:
  enable-prefix-caching: false
"""
JSON = json.dumps(
    {"seed": 7, "model": {"name": "/models/tiny", "max_model_len": 1024}, "engine": {"enable_prefix_caching": False}}
)


@pytest.fixture(autouse=True)
def _no_api_key_env(monkeypatch):
    monkeypatch.delenv("RLSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("name,text", [("c.toml", TOML), ("c.yaml", YAML), ("c.yml", YAML), ("c.json", JSON)])
def test_each_file_format(tmp_path, name, text):
    config = load_config(["@", write(tmp_path, name, text)])
    assert config.seed == 7
    assert config.model.name == "/models/tiny"
    assert config.model.max_model_len == 1024
    assert config.engine.enable_prefix_caching is False
    assert config.server.port == 8000  # untouched default


def test_no_args_gives_defaults():
    assert load_config([]) == Config()


def test_files_deep_merge_in_order(tmp_path):
    a = write(tmp_path, "a.toml", '[model]\nname = "a"\ndtype = "float32"\n[server]\nport = 1\n')
    b = write(tmp_path, "b.yaml", "model:\n  name: b\nserver:\n  host: 0.0.0.0\n")
    config = load_config(["@", a, f"@{b}"])
    assert config.model.name == "b"
    assert config.model.dtype == "float32"
    assert (config.server.host, config.server.port) == ("0.0.0.0", 1)
    assert load_config([f"@{b}", f"@{a}"]).model.name == "a"


def test_dotted_overrides_kebab_snake_and_equals():
    config = load_config(
        [
            "--model.name",
            "/path",
            "--server.port",
            "8001",
            "--model.max-model-len",
            "2048",
            "--engine.max_num_seqs=4",
            "--server.host=0.0.0.0",
            "--seed",
            "3",
        ]
    )
    assert config.model.name == "/path"
    assert config.server.port == 8001
    assert config.model.max_model_len == 2048
    assert config.engine.max_num_seqs == 4
    assert config.server.host == "0.0.0.0"
    assert config.seed == 3


def test_prime_rl_example_line(tmp_path):
    toml = write(tmp_path, "config.toml", "seed = 1\n[model]\nname = 'x'\n")
    yaml_ = write(tmp_path, "more.yaml", "server:\n  port: 9000\n")
    argv = f"@ {toml} @ {yaml_} --model.name /path --server.port 8001 --model.max_model_len 2048"
    argv += " --engine.enable-prefix-caching --no-engine.enable_prefix_caching --seed 3"
    config = load_config(argv.split())
    assert (config.seed, config.model.name, config.server.port) == (3, "/path", 8001)
    assert config.model.max_model_len == 2048
    assert config.engine.enable_prefix_caching is False


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--model.enforce-eager"], True),
        (["--model.enforce_eager", "--no-model.enforce_eager"], False),
        (["--no-model.enforce-eager", "--model.enforce-eager"], True),
        (["--model.enforce-eager", "true"], True),
        (["--model.enforce-eager", "false"], False),
        (["--model.enforce-eager=false"], False),
        (["--model.enforce-eager", "--seed", "1"], True),
    ],
)
def test_bool_flags(argv, expected):
    assert load_config(argv).model.enforce_eager is expected


def test_none_and_float_like_values():
    config = load_config(["--model.max_model_len", "64", "--model.max_model_len", "null", "--model.name", "none"])
    assert config.model.max_model_len is None and config.model.name is None
    assert load_config(["--engine.max_logprobs", "-1"]).engine.max_logprobs == -1


class Extras(Section):
    stop: list[str] = Field(default_factory=list, description="stop strings")
    weights: dict[str, float] = Field(default_factory=dict, description="per-name weights")
    temperature: float = Field(1.0, description="a float")


class ExtrasConfig(Config):
    extras: Extras = Field(default_factory=Extras)


def test_json_values_for_list_dict_and_section(tmp_path):
    path = write(tmp_path, "x.yaml", "extras:\n  stop: [a]\n  weights: {a: 1.0, b: 2.0}\n")
    config = load_config(
        ["@", path, "--extras.stop", '["x", "y"]', "--extras.weights", '{"c": 0.5}', "--extras.temperature", "0.25"],
        base=ExtrasConfig,
    )
    assert config.extras.stop == ["x", "y"]
    assert config.extras.weights == {"c": 0.5}  # a field's dict is replaced, not merged
    assert config.extras.temperature == 0.25
    config = load_config(["--model.name", "a", "--model", '{"max-model-len": 32}'], base=ExtrasConfig)
    assert (config.model.name, config.model.max_model_len) == ("a", 32)  # sections merge
    with pytest.raises(ConfigError, match=r"--extras\.stop expects JSON"):
        load_config(["--extras.stop", "[x"], base=ExtrasConfig)


def test_later_wins_and_cli_beats_files(tmp_path):
    assert load_config(["--seed", "1", "--seed", "2"]).seed == 2
    path = write(tmp_path, "s.toml", "seed = 5\n")
    assert load_config(["--seed", "1", "@", path]).seed == 1


def test_unknown_key_in_file_suggests(tmp_path):
    path = write(tmp_path, "bad.toml", '[model]\nnmae = "x"\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: unknown key 'model\.nmae'; did you mean 'model\.name'\?"):
        load_config(["@", path])
    path = write(tmp_path, "late.toml", '[model]\nname = "x"\nseed = 3\n')
    with pytest.raises(ConfigError, match=r"'model\.seed'; did you mean 'seed'\? \(in TOML, top-level keys go above"):
        load_config(["@", path])
    path = write(tmp_path, "bad.yaml", "modle:\n  name: x\n")
    with pytest.raises(ConfigError, match=r"'modle'.*did you mean 'model'"):
        load_config(["@", path])


@pytest.mark.parametrize(
    "argv,suggestion",
    [
        (["--model.nmae", "x"], "did you mean --model.name?"),
        (["--max-model-len", "8"], "did you mean --model.max_model_len?"),
        (["--engine.enable-prefix-cache"], "did you mean --engine.enable_prefix_caching?"),
        (["--sed=1"], "did you mean --seed?"),
    ],
)
def test_unknown_cli_key_suggests(argv, suggestion):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert argv[0].split("=")[0] in str(e.value)
    assert suggestion in str(e.value)


@pytest.mark.parametrize(
    "argv,field",
    [
        (["--server.port", "abc"], "server.port"),
        (["--server.port", "70000"], "server.port"),
        (["--model.max_model_len", "1.5"], "model.max_model_len"),
        (["--model.dtype", "fp8"], "model.dtype"),
        (["--engine.enable_prefix_caching=maybe"], "engine.enable_prefix_caching"),
    ],
)
def test_type_errors_name_the_field(argv, field):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert f"invalid value for {field}" in str(e.value)
    assert f"--{field} VALUE" in str(e.value)


def test_type_error_from_file_names_the_field(tmp_path):
    path = write(tmp_path, "t.yaml", "engine:\n  block_size: lots\n")
    with pytest.raises(ConfigError, match=r"engine\.block_size.*valid integer"):
        load_config(["@", path])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--seed"], "--seed needs a value"),
        (["--no-seed"], "--no- only applies to true/false keys"),
        (["serve"], "unexpected argument 'serve'"),
        (["@"], "'@' must be followed"),
        (["@/no/such/file.toml"], "cannot read config file"),
        (["@config.ini"], "unknown extension '.ini'"),
    ],
)
def test_argument_mistakes(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(argv)


def test_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot parse config file"):
        load_config(["@", write(tmp_path, "m.toml", "seed = = 1\n")])
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(["@", write(tmp_path, "m.yaml", "- 1\n- 2\n")])


def _leaf_fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        # optional sections ([logits_processors.*]: present = on) list their fields like any other
        inner = [a for a in typing.get_args(field.annotation) if a is not type(None)] or [field.annotation]
        if len(inner) == 1 and isinstance(inner[0], type) and issubclass(inner[0], BaseModel):
            yield from _leaf_fields(inner[0], f"{prefix}{name}.")
        else:
            yield prefix + name, field


@pytest.mark.parametrize("base", [Config, ExtrasConfig])
def test_help_lists_every_field_with_default(base):
    lines = help_text(base).splitlines()
    for path, field in _leaf_fields(base):
        [line] = [line for line in lines if line.strip().startswith(f"--{path} ")]
        default = field.get_default(call_default_factory=True)
        shown = "none" if default is None else str(default)
        if isinstance(default, (list, dict)):
            shown = json.dumps(default)
        assert f"(default: {shown.lower()})" in line.lower()
        assert field.description in line
    assert "\nmodel:" in "\n".join(lines) and "\nengine:" in "\n".join(lines)


def test_env_api_key_is_lowest_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_API_KEY", "vllm")
    assert load_config([]).server.api_key == "vllm"
    monkeypatch.setenv("RLSERVE_API_KEY", "ours")
    assert load_config([]).server.api_key == "ours"
    path = write(tmp_path, "k.toml", '[server]\napi_key = "file"\n')
    assert load_config(["@", path]).server.api_key == "file"
    assert load_config(["@", path, "--server.api-key", "cli"]).server.api_key == "cli"
    assert load_config(["--server.api_key", "none"]).server.api_key is None


def test_main_help_and_errors(capsys):
    assert main(["serve", "--help"]) == 0
    assert "--engine.block_size" in capsys.readouterr().out
    assert main(["--help"]) == 0
    assert "rlserve serve" in capsys.readouterr().out
    assert inference_main(["-h"]) == 0
    assert main(["serve", "--model.nmae", "x"]) == 2
    assert "did you mean --model.name?" in capsys.readouterr().err
    assert main(["bogus"]) == 2
    assert main([]) == 2


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([*args], capture_output=True, text=True, env=env, timeout=60)


def test_module_entry_serve_help():
    result = _run(sys.executable, "-m", "rlserve.cli", "serve", "--help")
    assert result.returncode == 0, result.stderr
    assert "--server.port" in result.stdout and "(default: 8000)" in result.stdout


def test_module_entry_config_error_exits_2_without_traceback():
    result = _run(sys.executable, "-m", "rlserve.cli", "serve", "--server.prot", "1")
    assert result.returncode == 2
    assert "did you mean --server.port?" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(shutil.which("rlserve") is None, reason="console script not installed")
def test_console_script_serve_help():
    result = _run("rlserve", "serve", "--help")
    assert result.returncode == 0, result.stderr
    assert "--model.name" in result.stdout


def test_serve_with_a_bad_model_exits_with_one_clear_line(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "rlserve.cli", "serve", "--model.name", str(tmp_path / "nope"), "--server.port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "no such directory" in out.stderr and "Traceback" not in out.stderr
