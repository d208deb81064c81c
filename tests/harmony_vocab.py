"""gpt-oss's vocabulary for openai-harmony without a download: tests/data/parsers/o200k_base.tiktoken.gz
(written by scripts/record_vllm_parsers.py, sha256-checked by openai-harmony itself) unpacked once and
named by TIKTOKEN_ENCODINGS_BASE, which servers started by the tests inherit; and a gpt-oss-shaped model (the
embedded one with Harmony's markers as special tokens) for what needs them as single tokens."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from pathlib import Path

VOCAB_GZ = Path(__file__).parent / "data" / "parsers" / "o200k_base.tiktoken.gz"


def use_harmony_vocab() -> None:
    named = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if named and (Path(named) / "o200k_base.tiktoken").is_file():
        return  # a folder named earlier is trusted only while it still holds the file
    folder = Path(tempfile.gettempdir()) / f"rlserve-harmony-vocab-{os.getuid()}"
    target = folder / "o200k_base.tiktoken"
    if not target.exists():
        folder.mkdir(exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}")
        partial.write_bytes(gzip.decompress(VOCAB_GZ.read_bytes()))
        partial.replace(target)
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)


# Harmony's control markers, renamed onto special tokens the embedded model's tokenizer holds but never uses
HARMONY_MARKERS = {
    "<|object_ref_start|>": "<|start|>",
    "<|object_ref_end|>": "<|end|>",
    "<|box_start|>": "<|channel|>",
    "<|box_end|>": "<|message|>",
    "<|quad_start|>": "<|constrain|>",
    "<|quad_end|>": "<|call|>",
    "<|vision_start|>": "<|return|>",
}
TEMPLATE = Path(__file__).parent / "data" / "parsers" / "templates" / "gpt_oss.jinja"


def make_gpt_oss_shaped(model_dir: Path, out: Path) -> Path:
    """A copy of the embedded model whose tokenizer holds Harmony's markers as single special tokens, with
    gpt-oss's chat template and stop tokens (`<|return|>`, `<|call|>`, `<|endoftext|>`): the random weights
    then write Harmony as gpt-oss does, a marker as one token."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix != ".json":
            shutil.copyfile(f, out / f.name)
            continue
        text = f.read_text()
        for old, new in HARMONY_MARKERS.items():
            text = text.replace(old, new)
        (out / f.name).write_text(text)
    added = {t["content"]: t["id"] for t in json.loads((out / "tokenizer.json").read_text())["added_tokens"]}
    stops = [added["<|return|>"], added["<|call|>"], added["<|endoftext|>"]]
    for name, edit in (
        ("generation_config.json", {"eos_token_id": stops}),
        ("config.json", {"eos_token_id": stops[0]}),
        ("tokenizer_config.json", {"eos_token": "<|return|>", "chat_template": TEMPLATE.read_text()}),
        ("special_tokens_map.json", {"eos_token": "<|return|>"}),
    ):
        (out / name).write_text(json.dumps(json.loads((out / name).read_text()) | edit, indent=2))
    return out
