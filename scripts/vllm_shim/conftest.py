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
