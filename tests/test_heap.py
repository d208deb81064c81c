"""The start-up heap frozen out of the cyclic collector (runtime/heap.py, called by the engine-core process and the
API server once they are up): objects made before the freeze are not walked by later collections, objects made after
still are."""

from __future__ import annotations

import subprocess
import sys
import textwrap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_frozen_objects_are_left_out_of_collections_and_later_ones_are_not():
    script = textwrap.dedent(
        """
        import gc, weakref
        from rlserve.runtime.heap import freeze_startup_heap
        from test_heap import Node
        before = Node()
        probe = weakref.ref(before)
        del before
        frozen = freeze_startup_heap()  # collects first: the start-up garbage goes
        assert probe() is None and frozen == gc.get_freeze_count() > 0
        kept = Node()
        kept_ref = weakref.ref(kept)
        freeze_startup_heap()
        del kept
        gc.collect()
        assert kept_ref() is not None, "a frozen cycle is not collected"
        after = Node()
        after_ref = weakref.ref(after)
        del after
        gc.collect()
        assert after_ref() is None, "what serving allocates is still collected"
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=__file__.rsplit("/", 1)[0]
    )
    assert out.stdout.strip() == "ok", out.stderr
