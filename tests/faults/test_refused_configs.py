"""Configurations that cannot work are refused up front with what to change, instead of failing later:
a context longer than the model's position table (at start), LoRA adapters that are not plain LoRA and an
adapter_config.json that is not JSON (400 on load, naming the field)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from conftest import start_server, stop_server


def test_max_model_len_past_the_position_table_is_refused_at_start() -> None:
    # the tiny model has 4096 positions; before, this started and the first sequence past 4096 killed the engine
    with pytest.raises(RuntimeError) as info:
        _url, proc = start_server("--model.max_model_len", "8192", "--engine.kv_cache_bytes", str(256 << 20))
        stop_server(proc)
    message = str(info.value)
    assert "server exited with code" in message
    assert "model.max_model_len=8192" in message and "max_position_embeddings=4096" in message


def test_max_model_len_equal_to_the_position_table_starts() -> None:
    url, proc = start_server("--model.max_model_len", "4096", "--engine.kv_cache_bytes", str(128 << 20))
    try:
        assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["max_model_len"] == 4096
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def adapter_server(root, peft_adapter):
    url, proc = start_server("--weight_roots", json.dumps([str(root)]))
    try:
        yield url
    finally:
        stop_server(proc)


# (case, change to adapter_config.json, field the 400 names)
NOT_PLAIN_LORA = [
    ("dora", {"use_dora": True}, "use_dora"),
    ("pissa", {"init_lora_weights": "pissa"}, "init_lora_weights"),
    ("pissa-niter", {"init_lora_weights": "pissa_niter_4"}, "init_lora_weights"),
    ("olora", {"init_lora_weights": "olora"}, "init_lora_weights"),
    ("modules-to-save", {"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ("lora-bias", {"lora_bias": True}, "lora_bias"),
]


@pytest.mark.parametrize(("case", "change", "field"), NOT_PLAIN_LORA, ids=[c[0] for c in NOT_PLAIN_LORA])
def test_adapter_that_is_not_plain_lora_is_refused(adapter_server, root, peft_adapter, case, change, field) -> None:
    source, _ = peft_adapter
    target = root / f"adapter-{case}"
    shutil.copytree(source, target, dirs_exist_ok=True)
    cfg = json.loads((source / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
    r = httpx.post(
        f"{adapter_server}/v1/load_lora_adapter", json={"lora_name": case, "lora_path": str(target)}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
    assert case not in [m["id"] for m in httpx.get(f"{adapter_server}/v1/models", timeout=30).json()["data"]]


def test_adapter_config_that_is_not_json_is_a_400(adapter_server, root, peft_adapter) -> None:
    source, _ = peft_adapter
    target = root / "adapter-not-json"
    shutil.copytree(source, target, dirs_exist_ok=True)
    (target / "adapter_config.json").write_text("r: 4\nlora_alpha: 16\n")
    r = httpx.post(
        f"{adapter_server}/v1/load_lora_adapter", json={"lora_name": "nj", "lora_path": str(target)}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert "is not JSON" in r.json()["error"]["message"]


def test_plain_lora_still_loads(adapter_server, root, peft_adapter) -> None:
    source, _ = peft_adapter
    cfg = json.loads((source / "adapter_config.json").read_text())
    assert not cfg.get("use_dora") and not cfg.get("modules_to_save")
    r = httpx.post(
        f"{adapter_server}/v1/load_lora_adapter", json={"lora_name": "plain", "lora_path": str(source)}, timeout=60
    )
    assert r.status_code == 200, r.text
