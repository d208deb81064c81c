"""Deterministic random-weight models written as ordinary Hugging Face directories.

`make_model` writes config.json, generation_config.json, model.safetensors and tokenizer files;
`default_model_dir` builds the embedded `tiny` model once into a cache folder and reuses it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

# Bump whenever the generator's output changes; the default model's cache folder also carries a
# hash of this file (default_model_dir), so an edit here never reuses a stale build.
ASSETS = Path(__file__).parent / "assets"  # the chat template and the tokenizer corpus, as plain files
FORMAT_VERSION = 2
TOKENIZER_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Like Qwen3: single ids that are never split, but kept in the text when special tokens are
# skipped, so reasoning and tool-call parsers still see them in decoded output.
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# The rest of Qwen3's added tokens, so renderers written for Qwen3 (verifiers') accept this
# tokenizer. They take the ids just below the ones above, which stay where they were.
QWEN3_SPECIAL_TOKENS = [
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
]
QWEN3_MARKUP_TOKENS = [
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
]
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
# Tied embeddings: logits = embedding @ rms_normed_hidden, so their std is about
# embed_std * sqrt(hidden): peaked enough for stable greedy ties, flat enough to sample from.
LOGIT_STD = 6.0
# Scale of what o_proj/down_proj write into the residual stream. Well above the embedding's, so the
# last token's own embedding does not dominate its tied logit (greedy would then repeat it).
RESIDUAL_GAIN = 2 * LOGIT_STD
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)

_COMMON = {
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "use_cache": True,
    "rope_scaling": None,
}
_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "use_sliding_window": False,
    "sliding_window": None,
}
PRESETS: dict[str, dict] = {
    "tiny": {
        **_COMMON,
        **_QWEN3,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "max_window_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": TOKENIZER_SIZE,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
    },
    "smollm2-135m": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "pretraining_tp": 1,
        "torch_dtype": "float32",
    },
    "qwen3-0.6b": {
        **_COMMON,
        **_QWEN3,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "max_window_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    },
}
_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "use_sliding_window": False,
    "sliding_window": None,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}
PRESETS |= {
    # test size: 8 experts, top-2, one dense layer (mlp_only_layers) among the sparse ones
    "tiny-moe": {
        **_COMMON,
        **_QWEN3_MOE,
        "hidden_size": 128,
        "intermediate_size": 384,
        "moe_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [2],
        "num_hidden_layers": 4,
        "max_window_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": TOKENIZER_SIZE,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
    },
    # Qwen3-30B-A3B's routing (128 experts, top-8, renormalised) and vocabulary at a quarter of its
    # width and layers (0.54B parameters, 2.2 GB in fp32): what fits a 2-core benchmark next to a
    # transformers copy of itself, with the real experts-per-token and expert-grouping pattern
    "qwen3-30b-a3b-mini": {
        **_COMMON,
        **_QWEN3_MOE,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "moe_intermediate_size": 192,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "mlp_only_layers": [],
        "num_hidden_layers": 12,
        "max_window_layers": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    },
}
# Router logits with a std of 4: well-separated expert scores, so top-k picks never hang on
# float rounding (engine and transformers must pick the same experts)
ROUTER_GAIN = 4.0

# Qwen3's own ChatML template (hermes-style tools, <think> for the latest assistant turn).
CHAT_TEMPLATE = (ASSETS / "chat_template.jinja").read_text()


_ADDED_TOKENS = [
    (QWEN3_SPECIAL_TOKENS, True),
    (QWEN3_MARKUP_TOKENS, False),
    (SPECIAL_TOKENS, True),
    (MARKUP_TOKENS, False),
]


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on CORPUS: any string round-trips, English compresses."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_SIZE - sum(len(tokens) for tokens, _ in _ADDED_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    for tokens, special in _ADDED_TOKENS:
        added = [AddedToken(t, special=special, normalized=False) for t in tokens]
        tok.add_special_tokens(added) if special else tok.add_tokens(added)
    assert tok.get_vocab_size() == TOKENIZER_SIZE, "CORPUS too small for the target vocabulary"
    return tok


def model_config(preset: str, tok: Tokenizer) -> dict:
    eot, eos = tok.token_to_id(PAD_TOKEN), tok.token_to_id(EOS_TOKEN)
    cfg = dict(PRESETS[preset], bos_token_id=eot, eos_token_id=eos, pad_token_id=eot)
    cfg["dtype"] = cfg["torch_dtype"]  # transformers 5 name; torch_dtype for older readers
    return cfg


def param_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes exactly as transformers' state_dict has them."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
        ]
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            shapes += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        shapes += [
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if _is_sparse(cfg, i):
            e_inter = cfg["moe_intermediate_size"]
            shapes.append((p + "mlp.gate.weight", (cfg["num_experts"], h)))
            for e in range(cfg["num_experts"]):
                x = f"{p}mlp.experts.{e}."
                shapes += [
                    (x + "gate_proj.weight", (e_inter, h)),
                    (x + "up_proj.weight", (e_inter, h)),
                    (x + "down_proj.weight", (h, e_inter)),
                ]
            continue
        shapes += [
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (cfg["vocab_size"], h)))
    return shapes


def _is_sparse(cfg: dict, layer: int) -> bool:
    """transformers' rule for which Qwen3-MoE layers hold experts."""
    return (
        cfg.get("num_experts", 0) > 0
        and layer not in cfg.get("mlp_only_layers", [])
        and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0
    )


def _init_tensor(name: str, shape: tuple[int, ...], hidden: int, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("mlp.gate.weight"):
        std = ROUTER_GAIN / math.sqrt(hidden)
    elif name in ("model.embed_tokens.weight", "lm_head.weight"):
        std = LOGIT_STD / math.sqrt(hidden)
    elif name.endswith(("o_proj.weight", "down_proj.weight")):
        std = RESIDUAL_GAIN / math.sqrt(shape[1])
    else:
        std = 1.0 / math.sqrt(shape[1])
    # float64 sampling takes torch's scalar path: the same bits on every CPU, unlike float32's SIMD path.
    return torch.randn(shape, generator=gen, dtype=torch.float64).mul_(std).float()


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _write_safetensors(
    path: Path,
    tensors: list[tuple[str, tuple[int, ...]]],
    dtype: torch.dtype,
    make: Iterator[torch.Tensor],
    metadata: dict[str, str],
) -> None:
    """Write the header from shapes, then each tensor as it is made: memory peaks at one tensor."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, shape in tensors:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for (name, shape), tensor in zip(tensors, make, strict=True):
            assert tuple(tensor.shape) == shape, name
            f.write(tensor.to(dtype).contiguous().view(torch.uint8).numpy().data)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


def _provenance(preset: str, seed: int) -> dict[str, str]:
    return {
        "format": "pt",
        "rlserve_preset": preset,
        "rlserve_seed": str(seed),
        "rlserve_format_version": str(FORMAT_VERSION),
    }


def _write_model(d: Path, preset: str, seed: int) -> None:
    tok = build_tokenizer()
    cfg = model_config(preset, tok)
    eot, eos = cfg["pad_token_id"], cfg["eos_token_id"]
    _write_json(d / "config.json", cfg)
    _write_json(d / "generation_config.json", {"bos_token_id": eot, "eos_token_id": [eos, eot], "pad_token_id": eot})
    tok.save(str(d / "tokenizer.json"))
    _write_json(
        d / "tokenizer_config.json",
        {
            # The generic fast class loads tokenizer.json as is; Qwen2Tokenizer would rebuild it with NFC.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "unk_token": None,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
            "model_max_length": cfg["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        d / "special_tokens_map.json",
        {
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": SPECIAL_TOKENS + QWEN3_SPECIAL_TOKENS,
        },
    )
    gen = torch.Generator().manual_seed(seed)
    shapes = param_shapes(cfg)
    tensors = (_init_tensor(n, s, cfg["hidden_size"], gen) for n, s in shapes)
    dtype = getattr(torch, cfg["torch_dtype"])
    _write_safetensors(d / "model.safetensors", shapes, dtype, tensors, _provenance(preset, seed))


def _is_complete(out: Path, expected: dict[str, str]) -> bool:
    """True if out already holds this exact model; raise if it holds something else."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return False
    if not all((out / f).is_file() for f in MODEL_FILES):
        raise FileExistsError(
            f"{out} exists but is not a complete model directory; remove it or choose another output path"
        )
    with safe_open(out / "model.safetensors", framework="pt") as f:
        found = f.metadata() or {}
    if found != expected:
        raise FileExistsError(
            f"{out} already holds a different model ({found}); remove it or choose another output path"
        )
    return True


def make_model(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a random-weight model for `preset` to out_dir (atomically) and return its path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    out = Path(out_dir).expanduser()
    expected = _provenance(preset, seed)
    if _is_complete(out, expected):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_model(tmp, preset, seed)
        tmp.chmod(0o755)  # mkdtemp made it private; the model is meant to be shared
        try:
            os.rename(tmp, out)
        except OSError:
            # Another process won the race: its directory is as good as ours.
            if not _is_complete(out, expected):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def cache_root() -> Path:
    """Where rlserve keeps what it builds: $RLSERVE_CACHE_DIR, or ~/.cache/rlserve."""
    return Path(os.environ.get("RLSERVE_CACHE_DIR") or Path.home() / ".cache" / "rlserve").expanduser()


def bench_cache_dir() -> Path:
    """Where benchmarks keep their models, per FORMAT_VERSION: make_model refuses a directory that holds
    another format's build, so a format change builds anew instead of failing on an old cache."""
    return cache_root() / "bench" / f"v{FORMAT_VERSION}"


def default_model_dir() -> Path:
    """The embedded tiny model, built once into $RLSERVE_CACHE_DIR (or ~/.cache/rlserve) under a
    name that changes with this file, so a changed generator never serves an old build."""
    return make_model("tiny", cache_root() / "models" / f"tiny-v{FORMAT_VERSION}-{generator_hash()}")


def generator_hash() -> str:
    """Of this file and its assets: a change to either makes a new cache directory."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    for asset in sorted(ASSETS.iterdir()):
        h.update(asset.read_bytes())
    return h.hexdigest()[:12]


def make_model_main(argv: list[str] | None = None) -> int:
    """`rlserve make-model --preset NAME --out DIR [--seed N]`."""
    parser = argparse.ArgumentParser(
        prog="rlserve make-model", description="Write a deterministic random-weight model as a Hugging Face directory."
    )
    parser.add_argument("--preset", required=True, choices=list(PRESETS))
    parser.add_argument("--out", required=True, type=Path, help="directory to create")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        print(make_model(args.preset, args.out, args.seed))
    except FileExistsError as e:
        parser.exit(1, f"rlserve make-model: error: {e}\n")
    return 0


# Varied plain English for the BPE merges; the tokenizer (and so every token id) depends on it.
CORPUS = (ASSETS / "corpus.txt").read_text()
