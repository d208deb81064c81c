import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rlserve.model.make import (
    FORMAT_VERSION,
    PRESETS,
    default_model_dir,
    generator_hash,
    make_model,
    make_model_main,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


def test_tiny_loads_in_transformers_with_a_peaked_distribution(tiny_dir, tok):
    config = AutoConfig.from_pretrained(tiny_dir)
    assert config.model_type == "qwen3" and config.architectures == ["Qwen3ForCausalLM"]
    assert config.vocab_size == len(tok) == 2048
    assert config.tie_word_embeddings

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) < 10_000_000
    on_disk = load_file(tiny_dir / "model.safetensors")
    assert set(model.state_dict()) - set(on_disk) == {"lm_head.weight"}  # tied
    for name, tensor in on_disk.items():
        assert torch.equal(model.state_dict()[name], tensor), name

    ids = tok("The library was open three days a week.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert torch.isfinite(logits).all()
    assert logits.std(-1).mean() > 2.0
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.05


def test_same_seed_same_bytes_other_seed_other_weights(tiny_dir, tmp_path):
    again = make_model("tiny", tmp_path / "again", seed=0)
    for name in ["model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"]:
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    other = load_file(make_model("tiny", tmp_path / "other", seed=1) / "model.safetensors")
    base = load_file(tiny_dir / "model.safetensors")
    assert not torch.equal(other["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert torch.equal(other["model.norm.weight"], base["model.norm.weight"])  # ones


def _random_text(rng: random.Random) -> str:
    pools = [
        lambda: chr(rng.randint(0x20, 0x7E)),
        lambda: rng.choice(" \n\t\r  \n\n"),
        lambda: chr(rng.randint(0x4E00, 0x9FFF)),  # CJK
        lambda: chr(rng.randint(0x1F300, 0x1FAFF)),  # emoji
        lambda: rng.choice(["👩‍💻", "🇯🇵", "👍🏽", "e\u0301", "Å", "ﬁ", "\u200b", "\x00"]),
        lambda: chr(rng.choice([rng.randint(0, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])),
    ]
    return "".join(rng.choice(pools)() for _ in range(rng.randint(0, 40)))


def test_any_string_round_trips_and_english_compresses(tok):
    rng = random.Random(0)
    for _ in range(300):
        text = _random_text(rng)
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert max(ids, default=0) < len(tok)
    english = "The weather was warm, so we walked along the river to the old bridge."
    assert len(tok.encode(english)) < len(english.encode()) / 2.5


def test_special_tokens_are_single_ids_and_qwen_like(tok):
    ids = {t: tok.encode(t, add_special_tokens=False) for t in SPECIALS + MARKUP}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert len({v[0] for v in ids.values()}) == len(ids)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == ids["<|im_end|>"][0]
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == ids["<|endoftext|>"][0]
    assert tok("hi").input_ids == tok.encode("hi", add_special_tokens=False)  # no BOS
    # ChatML markers are dropped with skip_special_tokens; reasoning/tool markup stays, as in Qwen3.
    text = "<|im_start|>assistant\n<think>x</think><tool_call>y</tool_call><|im_end|>"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == (
        "assistant\n<think>x</think><tool_call>y</tool_call>"
    )


def test_chat_template_renders_chatml(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    no_think = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think == prompt + "<think>\n\n</think>\n\n"
    answered = messages + [{"role": "assistant", "content": "Hello.", "reasoning_content": "Greet."}]
    assert tok.apply_chat_template(answered, tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\nGreet.\n</think>\n\nHello.<|im_end|>\n"
    )


def test_chat_template_renders_tools_and_tool_calls(tok):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    prompt = tok.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>" in prompt
    assert prompt.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_default_model_dir_is_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSERVE_CACHE_DIR", str(tmp_path))
    first = default_model_dir()
    assert first == tmp_path / "models" / f"tiny-v{FORMAT_VERSION}-{generator_hash()}"
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert AutoConfig.from_pretrained(first).vocab_size == 2048


def test_concurrent_builders_share_one_directory(tmp_path):
    out = tmp_path / "shared"
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: make_model("tiny", out), range(4)))
    assert paths == [out] * 4
    assert [p.name for p in tmp_path.iterdir()] == ["shared"]  # no temp dirs left behind


def test_refuses_to_reuse_a_directory_holding_another_model(tiny_dir):
    with pytest.raises(FileExistsError, match="different model"):
        make_model("tiny", tiny_dir, seed=1)
    with pytest.raises(ValueError, match="unknown preset"):
        make_model("tiny-typo", tiny_dir)


def test_cli_writes_the_directory(tmp_path, capsys):
    assert make_model_main(["--preset", "tiny", "--out", str(tmp_path / "m"), "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    with safe_open(tmp_path / "m" / "model.safetensors", framework="pt") as f:
        assert f.metadata()["rlserve_seed"] == "3"


@pytest.mark.slow
def test_smollm2_shape(tmp_path):
    out = make_model("smollm2-135m", tmp_path / "smol")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert {k: config[k] for k in PRESETS["smollm2-135m"]} == PRESETS["smollm2-135m"]
    with safe_open(out / "model.safetensors", framework="pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 (not iterable)
    assert "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == [49152, 576]
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 134_515_008


def test_tokenizer_has_qwen3_added_tokens(tmp_path, monkeypatch):
    """Renderers written for Qwen3 look these up; the older markup ids stay where they were."""
    monkeypatch.setenv("RLSERVE_CACHE_DIR", str(tmp_path))
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    qwen3 = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|object_ref_start|>",
        "<|object_ref_end|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    ]
    ids = tok.convert_tokens_to_ids(qwen3)
    assert len(set(ids)) == len(qwen3) and tok.unk_token_id not in ids
    assert all(tok.encode(t, add_special_tokens=False) == [i] for t, i in zip(qwen3, ids))
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "</think>", "</tool_call>"]) == [
        2041,
        2043,
        2045,
        2047,
    ]
    # Qwen3's split: control tokens vanish with skip_special_tokens, markup stays in the text
    text = tok.decode(
        tok.convert_tokens_to_ids(["<|vision_pad|>", "<tool_response>", "<|im_end|>"]), skip_special_tokens=True
    )
    assert text == "<tool_response>"
