"""engine/kv/transfer.py and engine/kv/wire.py in process: two real engines (prefill and decode) with their block server and puller.
Mismatched or failed transfers prefill locally with the same output, pins end on pull, release, abort and
timeout (twice is harmless), and the block server survives bad input."""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time

import numpy as np
import pytest
import torch

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.kv.format import KVBlock
from rlserve.engine.kv.wire import recv_frame, send_frame
from rlserve.engine.params import SamplingParams

PROMPT = list(range(7, 7 + 70))


def engine(**transfer) -> Engine:
    return Engine(
        Config.model_validate(
            {"engine": {"kv_cache_bytes": 8 << 20}, "model": {"max_model_len": 256}, "kv_transfer": transfer}
        )
    )


@pytest.fixture(scope="module")
def engines():
    p, d = engine(pin_timeout_s=1.0), engine()
    yield p, d
    p.close()
    d.close()


def run(e: Engine, params: SamplingParams, rid: str = "r", prompt: list[int] = PROMPT):
    e.add_request(rid, prompt, params)
    deadline = time.monotonic() + 120  # a hang guard, not a speed bar
    while time.monotonic() < deadline:
        for out in e.step():
            if out.finished:
                return out
        time.sleep(0.001)
    raise AssertionError("no output")


def prefill(p: Engine) -> dict:
    out = run(p, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    return out.kv_transfer_params


def settle(p: Engine, condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        p.poll_transfers()
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def decode(d: Engine, kt: dict | None) -> list[int]:
    d.pool.reset_prefix_cache()  # every case starts cold on D
    return run(d, SamplingParams(max_tokens=5, temperature=0, kv_transfer_params=kt)).outputs[0].token_ids


@pytest.mark.parametrize(
    "field, value",
    [("weight_generation", 5), ("block_size", 32), ("dtype", "bfloat16"), ("kv_shape", [1, 2, 16, 1, 1])],
)
def test_a_mismatch_prefills_locally_and_releases_the_pin(engines, field, value):
    p, d = engines
    want = decode(d, None)
    kt = prefill(p)
    fallbacks, pulled = d.kv_transfer.stats.fallbacks, d.kv_transfer.stats.tokens_in
    assert decode(d, kt | {field: value}) == want
    assert d.kv_transfer.stats.fallbacks == fallbacks + 1 and d.kv_transfer.stats.tokens_in == pulled
    settle(p, lambda: p.kv_transfer.pinned_blocks == 0, "the release to reach P")


def test_a_pull_pins_nothing_afterwards_and_equals_local_prefill(engines):
    p, d = engines
    want = decode(d, None)
    kt = prefill(p)
    computed = d.stats.prompt_tokens_computed
    assert decode(d, kt) == want
    assert d.stats.prompt_tokens_computed - computed == len(PROMPT) - (len(PROMPT) - 1) // 16 * 16
    settle(p, lambda: p.kv_transfer.pinned_blocks == 0 and p.pool.num_free == p.pool.num_blocks, "P to unpin")
    # the same transfer again: P has freed it, D's pull is refused and D prefills itself
    failures = d.kv_transfer.stats.pull_failures
    assert decode(d, kt) == want
    assert d.kv_transfer.stats.pull_failures == failures + 1


def test_abort_and_timeout_free_pins_and_repeat_releases_are_harmless(engines):
    p, _ = engines
    kt = prefill(p)
    assert p.kv_transfer.pinned_blocks == len(kt["remote_block_ids"])
    p.abort(kt["remote_request_id"])
    assert p.kv_transfer.pinned_blocks == 0
    p.abort(kt["remote_request_id"])  # already freed
    with socket.create_connection(("127.0.0.1", kt["remote_port"])) as s:
        send_frame(s, {"op": "release", "transfer_id": kt["transfer_id"]})
    settle(p, lambda: p.pool.num_free == p.pool.num_blocks, "every block to be free")
    expired = p.kv_transfer.stats.expired
    prefill(p)
    settle(p, lambda: p.kv_transfer.pinned_blocks == 0, "the 1 s pin timeout")
    assert p.kv_transfer.stats.expired == expired + 1


def test_the_block_server_answers_bad_input_and_keeps_serving(engines):
    p, d = engines
    kt = prefill(p)
    port = kt["remote_port"]
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(struct.pack("<I", 1 << 30))  # a frame length beyond the limit: the server hangs up
        assert s.recv(1) == b""
    with socket.create_connection(("127.0.0.1", port)) as s:
        send_frame(s, {"op": "pull", "transfer_id": "nope", "first": 0, "count": 1})
        assert recv_frame(s)["ok"] is False
    with socket.create_connection(("127.0.0.1", port)) as s:
        send_frame(s, {"op": "pull", "transfer_id": kt["transfer_id"], "first": 0, "count": 999})
        assert "outside" in recv_frame(s)["error"]
    settle(p, lambda: p.kv_transfer.pinned_blocks == 0, "the refused pull's connection to free the pin")
    kt = prefill(p)
    assert decode(d, kt) == decode(d, None)


def test_abort_on_d_while_pulling_frees_everything(engines):
    p, d = engines
    kt = prefill(p)
    d.pool.reset_prefix_cache()
    d.add_request("a", PROMPT, SamplingParams(max_tokens=5, kv_transfer_params=kt))
    d.abort("a")
    settle(d, lambda: not d.transfers_pending, "the pull to land")
    d.step()
    assert all(d.pool.is_free(b) for b in range(d.pool.num_blocks))
    settle(p, lambda: p.kv_transfer.pinned_blocks == 0, "P to unpin")


def test_under_non_cached_tokens_d_prefills_itself(engines):
    p, _ = engines
    d = engine(non_cached_tokens=len(PROMPT) + 1)
    try:
        want = decode(d, None)
        assert decode(d, prefill(p)) == want
        assert d.kv_transfer.stats.skipped == 1 and d.kv_transfer.stats.tokens_in == 0
        settle(p, lambda: p.kv_transfer.pinned_blocks == 0, "the release to reach P")
    finally:
        d.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_block_is_sent_from_the_pool_itself_as_the_bytes_of_its_contiguous_copy(dtype):
    from rlserve.engine.kv import format as kv_format

    pool = torch.randn(3, 2, 64 * 16, 2, 64).to(dtype)
    block = pool[:, :, 16 * 16 : 17 * 16]  # strided: one run per layer and k/v
    parts = kv_format.encode_parts(KVBlock(b"h" * 16, block, 2))
    assert b"".join(parts) == kv_format.encode(KVBlock(b"h" * 16, block.contiguous(), 2))
    start, end = pool.data_ptr(), pool.data_ptr() + pool.nbytes
    payload = parts[1:-1]
    assert len(payload) == 6 and all(start <= _address(p) < end for p in payload)  # views, not copies
    back = kv_format.decode(bytearray(b"".join(parts)), expect_shape=tuple(block.shape), expect_dtype=dtype)
    assert torch.equal(back.kv, block)


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def test_a_remote_host_outside_peer_hosts_is_never_contacted(engines):
    """A client cannot make the decode server connect where it likes: it prefills locally instead."""
    p, _ = engines
    d = engine(peer_hosts=["::1"])
    try:
        kt = prefill(p)
        with socket.create_server(("127.0.0.1", 0)) as trap:  # where the request points D
            trap.setblocking(False)
            fallbacks = d.kv_transfer.stats.fallbacks
            got = decode(d, {**kt, "remote_port": trap.getsockname()[1]})
            assert got == decode(d, None) and d.kv_transfer.stats.fallbacks == fallbacks + 1
            assert d.kv_transfer.stats.pulls == 0
            with pytest.raises(BlockingIOError):  # the request finished without a pull: nobody connected
                trap.accept()
        settle(p, lambda: p.kv_transfer.pinned_blocks == 0, "the unpulled pin to time out")
    finally:
        d.close()


@pytest.mark.parametrize("one_block_per_receive", [False, True])
def test_pulled_blocks_are_the_prefill_servers_bytes_in_d_s_own_pool(engines, one_block_per_receive, monkeypatch):
    """D receives a cache-sized group of blocks per call and checks their checksums there: the tiny model's
    blocks all fit one group, so the pull is also made one block per receive, as a larger model's are."""
    from rlserve.engine.kv import wire as kv_wire

    if one_block_per_receive:
        monkeypatch.setattr(kv_wire, "_CHECK_BYTES", 1)
    p, d = engines
    kt = prefill(p)
    src = [p.runner.kv_cache[:, :, b * 16 : (b + 1) * 16].clone() for b in kt["remote_block_ids"]]
    d.pool.reset_prefix_cache()
    d.add_request("x", PROMPT, SamplingParams(max_tokens=1, kv_transfer_params=kt))
    settle(d, lambda: not d.transfers_pending, "the pull to land")
    held = d.requests["x"][0].held_blocks  # the reserved blocks the pull wrote, now registered
    assert len(held) == (len(PROMPT) - 1) // 16
    for b, want in zip(held, src):
        assert torch.equal(d.runner.kv_cache[:, :, b * 16 : (b + 1) * 16], want)
    while d.has_unfinished():
        d.step()
    settle(p, lambda: p.kv_transfer.pinned_blocks == 0, "P to free the pulled blocks")


class FakePrefillServer:
    """Speaks the block wire protocol with the blocks a prefill server announced, spoiled on the way."""

    def __init__(self, kt: dict, spoil: str):
        self.kt, self.spoil = kt, spoil
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        from rlserve.engine.kv import format as kv_format

        conn, _ = self.sock.accept()
        with conn, contextlib.suppress(ConnectionError):  # D hangs up at the first block it refuses
            ask = recv_frame(conn)
            send_frame(conn, {"ok": True, "blocks": ask["count"]})
            shape = tuple(self.kt["kv_shape"])
            kv = torch.randn(shape)
            for i, h in enumerate(self.kt["block_hashes"][ask["first"] : ask["first"] + ask["count"]]):
                block_hash = bytes.fromhex(h)[::-1] if self.spoil == "foreign" else bytes.fromhex(h)
                parts = kv_format.kv_parts(
                    block_hash, self.kt["weight_generation"], shape, torch.float32, kv_format.tensor_views(kv)
                )
                data = b"".join(bytes(memoryview(x).cast("B")) for x in parts)
                if self.spoil == "checksum" and i == 1:
                    data = data[:-100] + bytes(1) + data[-99:]  # one payload byte flipped after hashing
                if self.spoil == "short" and i == 1:
                    conn.sendall(struct.pack("<Q", len(data)) + data[: len(data) // 2])
                    return
                conn.sendall(struct.pack("<Q", len(data)) + data)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("spoil", ["checksum", "short", "foreign"])
def test_a_spoiled_pull_frees_its_reserved_blocks_and_d_prefills_locally(engines, spoil, caplog):
    """D receives straight into reserved pool blocks: a block that fails its checksum, never fully arrives
    or holds other tokens' KV (another hash in its header) frees them all, and the request prefills locally
    with the same output."""
    caplog.set_level(logging.INFO, logger="rlserve.engine.kv.transfer")
    p, d = engines
    want = decode(d, None)
    kt = prefill(p)
    fake = FakePrefillServer(kt, spoil)
    try:
        failures, fallbacks = d.kv_transfer.stats.pull_failures, d.kv_transfer.stats.fallbacks
        d.pool.reset_prefix_cache()
        params = SamplingParams(max_tokens=5, temperature=0, kv_transfer_params=kt | {"remote_port": fake.port})
        d.add_request("s", PROMPT, params)
        settle(d, lambda: not d.transfers_pending, "the pull to fail")
    finally:
        fake.close()
    assert d.kv_transfer.stats.fallbacks == fallbacks + 1
    assert d.kv_transfer.stats.pull_failures == failures + (spoil != "foreign")  # that one arrived intact
    assert {"checksum": "checksum mismatch", "short": "connection closed", "foreign": "computed for other tokens"}[
        spoil
    ] in caplog.text
    assert all(d.pool.is_free(b) for b in range(d.pool.num_blocks))  # the reserved blocks are back
    computed = d.stats.prompt_tokens_computed
    got = None
    while got is None:
        got = next((o.outputs[0].token_ids for o in d.step() if o.finished), None)
    assert got == want and d.stats.prompt_tokens_computed - computed == len(PROMPT)
    settle(p, lambda: p.kv_transfer.pinned_blocks == 0, "the unpulled pin to time out")


# ---- router replay: each block's routed experts travel with its KV ----------------------------


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(P with router replay, D with router replay, a server without it) on a tiny Qwen3-MoE."""
    from rlserve.model.make import make_model

    model = make_model("tiny-moe", tmp_path_factory.mktemp("models") / "tiny-moe")

    def moe_engine(replay: bool) -> Engine:
        return Engine(
            Config.model_validate(
                {
                    "model": {"name": str(model), "max_model_len": 256},
                    "engine": {"kv_cache_bytes": 8 << 20},
                    "kv_transfer": {"pin_timeout_s": 1.0},
                    "enable_return_routed_experts": replay,
                }
            )
        )

    engines = moe_engine(True), moe_engine(True), moe_engine(False)
    yield engines
    for e in engines:
        e.close()


def replay_decode(d: Engine, kt: dict | None):
    d.pool.reset_prefix_cache()
    return run(d, SamplingParams(max_tokens=5, temperature=0, kv_transfer_params=kt)).outputs[0]


def test_pulled_blocks_bring_their_routed_experts_into_d_s_rows(moe):
    """D's rows of the blocks it pulled are P's; a D without router replay asks for the KV alone."""
    p, d, plain = moe
    kt = prefill(p)
    assert kt["block_metadata"] == {"routed_experts": {"shape": [16, 3, 2], "dtype": "uint8"}}
    src = [p.runner.routing.block_rows(b).clone() for b in kt["remote_block_ids"]]
    d.pool.reset_prefix_cache()
    d.add_request("x", PROMPT, SamplingParams(max_tokens=1, kv_transfer_params=kt))
    settle(d, lambda: not d.transfers_pending, "the pull to land")
    held = d.requests["x"][0].held_blocks
    assert len(held) == (len(PROMPT) - 1) // 16 and d.kv_transfer.stats.fallbacks == 0
    for b, want in zip(held, src):
        assert want.any() and torch.equal(d.runner.routing.block_rows(b), want)
    while d.has_unfinished():
        d.step()
    settle(p, lambda: p.kv_transfer.pinned_blocks == 0, "P to free the pulled blocks")
    want = replay_decode(plain, None)
    pulled = plain.kv_transfer.stats.tokens_in
    assert replay_decode(plain, prefill(p)).token_ids == want.token_ids
    assert plain.kv_transfer.stats.tokens_in - pulled == (len(PROMPT) - 1) // 16 * 16
    settle(p, lambda: p.kv_transfer.pinned_blocks == 0, "P to free the pulled blocks")


def test_blocks_without_routed_experts_are_recomputed_never_zeros(moe, caplog, monkeypatch):
    """A D with router replay takes no block without its routed experts: from a P without replay it prefills
    locally (P's params say its blocks carry none), and a block that arrives without them (a P that claims
    them) fails the pull. Either way its routed experts equal a local prefill's."""
    from rlserve.engine.kv import wire as kv_wire

    monkeypatch.setattr(kv_wire, "_CHECK_BYTES", 1)  # one block per receive: the short block's size is read whole
    caplog.set_level(logging.INFO, logger="rlserve.engine.kv.transfer")
    p, d, plain = moe
    want = replay_decode(d, None)
    fallbacks, failures = d.kv_transfer.stats.fallbacks, d.kv_transfer.stats.pull_failures
    got = replay_decode(d, prefill(plain))
    assert "carry no routed_experts" in caplog.text and d.kv_transfer.stats.fallbacks == fallbacks + 1
    assert got.token_ids == want.token_ids and np.array_equal(got.routed_experts, want.routed_experts)
    settle(plain, lambda: plain.kv_transfer.pinned_blocks == 0, "the release to reach the plain P")
    kt = prefill(p)
    fake = FakePrefillServer(kt, "kv only")  # KV alone, whatever the pull asks for
    try:
        got = replay_decode(d, kt | {"remote_port": fake.port})
    finally:
        fake.close()
    assert "of KV and ['routed_experts']" in caplog.text.split("KV pull failed")[-1]
    assert d.kv_transfer.stats.pull_failures == failures + 1 and d.kv_transfer.stats.fallbacks == fallbacks + 2
    assert got.token_ids == want.token_ids and np.array_equal(got.routed_experts, want.routed_experts)
    settle(p, lambda: p.kv_transfer.pinned_blocks == 0, "the unpulled pin to time out")
