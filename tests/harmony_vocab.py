"""gpt-oss's vocabulary for openai-harmony without a download: tests/data/parsers/o200k_base.tiktoken.gz
(written by scripts/record_vllm_parsers.py, sha256-checked by openai-harmony itself) unpacked once and
named by TIKTOKEN_ENCODINGS_BASE, which servers started by the tests inherit."""

from __future__ import annotations

import gzip
import os
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
