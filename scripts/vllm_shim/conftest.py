"""Stands in for vLLM's tests/conftest.py (which needs all of vLLM and a GPU): makes a vLLM install's
site-packages importable after everything else when RLSERVE_SHIM_VLLM_SITE names one, so test files that
import vLLM helpers can run; the server under test is rlserve (tests/utils.py)."""

import os
import sys

site = os.environ.get("RLSERVE_SHIM_VLLM_SITE")
if site and site not in sys.path:
    sys.path.append(site)


def __getattr__(name: str):
    """`from tests.conftest import X` (LocalAssetServer, ...): vLLM's own conftest, imported only then."""
    import importlib

    return getattr(importlib.import_module("tests.vllm_conftest"), name)


def _stand_in(name):
    """A hub model id the tests load a tokenizer for names the served stand-in; local paths stay."""
    model = os.environ.get("RLSERVE_SHIM_MODEL")
    if model and isinstance(name, str) and not os.path.exists(name):
        return model
    return name


def _point_tokenizers_at_stand_in() -> None:
    """The server serves the stand-in under the test's model name, so the test's own tokenizer (to compare
    token ids with the server's) must be the stand-in's too; the hub is not reachable here anyway."""
    import transformers

    auto = transformers.AutoTokenizer.from_pretrained
    transformers.AutoTokenizer.from_pretrained = lambda name, *a, **kw: auto(_stand_in(name), *a, **kw)
    if not site:
        return
    try:
        import vllm.tokenizers as vllm_tokenizers
    except ImportError:
        return
    get = vllm_tokenizers.get_tokenizer

    def get_tokenizer(tokenizer_name=None, *args, **kwargs):
        return get(_stand_in(tokenizer_name), *args, **kwargs)

    vllm_tokenizers.get_tokenizer = get_tokenizer


_point_tokenizers_at_stand_in()
