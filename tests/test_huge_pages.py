"""The weights' GEMM panels live in one buffer on 2 MiB pages (model/huge_pages.py)."""

from __future__ import annotations

import pytest
import torch

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.model.huge_pages import HUGE_PAGE, huge_page_buffer
from rlserve.model.linear import Projection


@pytest.mark.parametrize("nbytes", [1, 4096, HUGE_PAGE, 3 * HUGE_PAGE + 17])
def test_huge_page_buffer_is_aligned_and_holds_its_bytes(nbytes):
    buf = huge_page_buffer(nbytes)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes
    assert buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(7)
    assert int(buf.sum()) == 7 * nbytes


def test_panels_share_one_huge_page_buffer(model_dir):
    cfg = Config()
    cfg.model.name, cfg.model.max_model_len = str(model_dir), 256
    cfg.engine.kv_cache_bytes = 4 << 20
    engine = Engine(cfg)
    model = engine.runner.model
    if model.panel_head is None:
        pytest.skip("this CPU keeps the GEMM libraries' packed weights (no AVX-512 panels)")
    panels = [m.panels.get(m.weight) for m in model.modules() if isinstance(m, Projection)]
    panels.append(model.panel_head.get(model.logits_weight))
    storages = {p.untyped_storage().data_ptr() for p in panels}
    assert len(storages) == 1, "each panel in a buffer of its own"
    assert min(p.data_ptr() for p in panels) % HUGE_PAGE == 0
