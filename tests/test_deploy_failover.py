"""Streams through the real vllm-router when a process dies under them: what the client sees and what
rlserve's client does with it. A replica killed mid-stream cuts the body (never a clean end), and the
client raises the typed, retryable StreamInterrupted; a replica killed before the first chunk is retried
by the router; a router killed under waiting calls is retried by the client until it is back.

"Still streaming" and "not started yet" are made true by construction with /pause?mode=keep and checked
on the replicas' own counters before anything is killed."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from deploy_helpers import replicas, start_deployment, stop_deployment, wait_for
from rlserve.client import InferenceClient, RetryableError, StreamInterrupted

LONG = 1800  # tokens a stream asks for: far more than it produces before the pause lands
SHORT = 8


@pytest.fixture(scope="module")
def deployment():
    public, admin, proc = start_deployment("--deployment.replicas", "2", "--model.max_model_len", "2048")
    try:
        yield public, admin, proc
    finally:
        stop_deployment(proc)


def both_serving(admin: str) -> list[dict]:
    return wait_for(
        lambda: (rows := replicas(admin)) and all(r["status"] == "serving" for r in rows) and rows,
        600,
        "both replicas serving",
    )


def busy(admin: str) -> list[dict]:
    return [r for r in replicas(admin) if r.get("running", 0) + r.get("waiting", 0) > 0]


def kill_and_wait_for_eviction(admin: str, victim: dict) -> None:
    """SIGKILL one replica; the admin address answers for the others once it left the rotation."""
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(
        lambda: victim["url"] not in [r["url"] for r in replicas(admin) if r["status"] == "serving"], 120, "eviction"
    )


def body(max_tokens: int, stream: bool) -> dict:
    return {"prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


async def pause(http: httpx.AsyncClient, admin: str) -> None:
    (await http.post(f"{admin}/pause", params={"mode": "keep"}, timeout=120)).raise_for_status()


async def resume(http: httpx.AsyncClient, admin: str) -> None:
    (await http.post(f"{admin}/resume", timeout=120)).raise_for_status()


async def collect(chunks) -> list[dict]:
    return [chunk async for chunk in chunks]


def test_a_replica_killed_mid_stream_is_a_retryable_error_not_a_short_answer(deployment):
    public, admin, _ = deployment
    both_serving(admin)

    async def scenario():
        async with httpx.AsyncClient(timeout=300) as http, InferenceClient(public, retry_deadline=300) as client:
            stream = await client.completions.create(**body(LONG, True), session_id="cut")
            received = [await anext(stream)]
            raw = http.stream(
                "POST", f"{public}/v1/completions", json=body(LONG, True), headers={"X-Session-ID": "cut"}
            )  # same session: same replica
            response = await raw.__aenter__()
            lines = response.aiter_lines()
            raw_lines = [line async for line in _until_first_data(lines)]
            await pause(http, admin)
            (victim,) = busy(admin)  # both streams are still running on one replica, frozen by the pause
            assert victim["running"] == 2
            await asyncio.to_thread(kill_and_wait_for_eviction, admin, victim)
            await resume(http, admin)

            # through the router the body is cut: httpx reports an incomplete chunked read, never a clean end
            with pytest.raises(httpx.RemoteProtocolError):
                async for line in lines:
                    raw_lines.append(line)
            await raw.__aexit__(None, None, None)
            assert "data: [DONE]" not in raw_lines

            with pytest.raises(StreamInterrupted) as cut:
                async for chunk in stream:
                    received.append(chunk)
            assert isinstance(cut.value, RetryableError) and cut.value.received == len(received) >= 1

            # sent again from scratch, the same request completes on the surviving replica
            again = await collect(await client.completions.create(**body(LONG, True), session_id="cut"))
            return received, again

    received, again = asyncio.run(scenario())
    assert again[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in again)
    assert text.startswith("".join(c["choices"][0]["text"] for c in received))  # temperature 0: same tokens


async def _until_first_data(lines):
    async for line in lines:
        yield line
        if line.startswith("data:"):
            return


def test_a_replica_killed_before_the_first_chunk_is_retried_to_a_full_answer(deployment):
    public, admin, _ = deployment
    both_serving(admin)

    async def scenario():
        async with httpx.AsyncClient(timeout=300) as http, InferenceClient(public, retry_deadline=300) as client:
            await pause(http, admin)
            try:
                # allow_mixed_versions: the client itself would hold calls while it sees the deployment paused
                streamed = asyncio.ensure_future(
                    collect(
                        await client.completions.create(
                            **body(SHORT, True), session_id="early", allow_mixed_versions=True
                        )
                    )
                )
                plain = asyncio.ensure_future(
                    client.completions.create(**body(SHORT, False), session_id="early", allow_mixed_versions=True)
                )
                victims = await asyncio.to_thread(
                    wait_for, lambda: [r for r in busy(admin) if r["running"] + r["waiting"] == 2], 120, "2 queued"
                )
                await asyncio.to_thread(kill_and_wait_for_eviction, admin, victims[0])
            finally:
                await resume(http, admin)
            return await streamed, await plain

    streamed, plain = asyncio.run(scenario())
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in streamed) == plain["choices"][0]["text"]
    assert plain["usage"]["completion_tokens"] == SHORT


def test_the_client_retries_calls_cut_by_a_dying_router_until_it_is_back(deployment):
    public, admin, _ = deployment
    both_serving(admin)

    async def scenario():
        async with (
            httpx.AsyncClient(timeout=300) as http,
            InferenceClient(public, retry_deadline=300, probe_interval=0.5) as client,
        ):
            await pause(http, admin)
            try:
                streamed = asyncio.ensure_future(
                    collect(
                        await client.completions.create(
                            **body(SHORT, True), session_id="router", allow_mixed_versions=True
                        )
                    )
                )
                plain = asyncio.ensure_future(
                    client.completions.create(**body(SHORT, False), session_id="router", allow_mixed_versions=True)
                )
                await asyncio.to_thread(
                    wait_for, lambda: sum(r["running"] + r["waiting"] for r in busy(admin)) == 2, 120, "2 queued"
                )
                router = (await http.get(f"{admin}/deployment")).json()["router_pid"]
                os.kill(router, signal.SIGKILL)
            finally:
                await resume(http, admin)
            return await streamed, await plain

    streamed, plain = asyncio.run(scenario())
    assert "".join(c["choices"][0]["text"] for c in streamed) == plain["choices"][0]["text"]
    assert plain["usage"]["completion_tokens"] == SHORT
