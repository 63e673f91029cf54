"""The P/D handshake on one machine: a decode side registers with a prefill side's bootstrap
server over HTTP and posts a room; the prefill side writes the prompt's KV into the posted
slots with the first token in the notification; either side gives up on a room whose
partner never comes, and a decode pool of another shape is refused at registration."""

from __future__ import annotations

import time

import pytest
import torch

from kubesgl.engine.disagg.bootstrap import BootstrapServer, DecodeTransfers, PrefillTransfers
from kubesgl.engine.disagg.kv_transfer import KVTransferAgent


@pytest.fixture
def pair(filled_kv_pool):
    """(prefill pool, decode pool, PrefillTransfers, DecodeTransfers) wired over loopback."""
    made = []

    def make(timeout: float = 10.0, decode_kv_heads: int = 2):
        prefill_pool, decode_pool = filled_kv_pool(1), filled_kv_pool(None, kv_heads=decode_kv_heads)
        prefill_agent, decode_agent = KVTransferAgent(prefill_pool), KVTransferAgent(decode_pool)
        server = BootstrapServer(prefill_agent.layout, host="127.0.0.1", port=0)
        prefill = PrefillTransfers(prefill_agent, server, timeout)
        decode = DecodeTransfers(decode_agent, timeout)
        made.append((server, decode, prefill_agent, decode_agent))
        return prefill_pool, decode_pool, prefill, decode, server.port

    yield make
    for server, decode, *agents in made:
        decode.close()
        server.close()
        for agent in agents:
            agent.close()


def run_until(prefill: PrefillTransfers, decode: DecodeTransfers, want: int, timeout: float = 15.0):
    """Poll both sides like two schedulers would until `want` results came back in all."""
    sent, arrived = [], []
    deadline = time.monotonic() + timeout
    while len(sent) + len(arrived) < want:
        assert time.monotonic() < deadline, f"timed out with {sent} {arrived}"
        sent += prefill.poll()
        arrived += decode.poll()
        time.sleep(0.002)
    return sent, arrived


def test_a_room_moves_its_prompt_kv_and_first_token(pair):
    prefill_pool, decode_pool, prefill, decode, port = pair()
    src, dst = [3, 4, 5, 6, 20], [40, 41, 42, 7, 8]
    decode.expect(77, "127.0.0.1", port, dst)
    prefill.prefilled(77, src, first_token=1234)
    sent, arrived = run_until(prefill, decode, want=2)
    assert [r.room for r in sent] == [77] and sent[0].ok
    assert [(r.room, r.first_token, r.ok) for r in arrived] == [(77, 1234, True)]
    for here, there in zip(prefill_pool.k + prefill_pool.v, decode_pool.k + decode_pool.v):
        assert torch.equal(there[dst], here[src])


def test_rooms_pair_up_whatever_the_order_and_registration_happens_once(pair):
    prefill_pool, decode_pool, prefill, decode, port = pair()
    prefill.prefilled(1, [10, 11], first_token=5)  # prefilled before the decode side asked
    decode.expect(1, "127.0.0.1", port, [50, 51])
    decode.expect(2, "127.0.0.1", port, [52])
    prefill.prefilled(2, [12], first_token=6)
    sent, arrived = run_until(prefill, decode, want=4)
    assert sorted((r.room, r.first_token) for r in arrived) == [(1, 5), (2, 6)]
    assert len(prefill.agent.peers) == 1
    assert torch.equal(decode_pool.k[1][[50, 51, 52]], prefill_pool.k[1][[10, 11, 12]])


def test_a_partner_that_never_comes_times_out_on_both_sides(pair):
    _, _, prefill, decode, port = pair(timeout=0.3)
    prefill.prefilled(8, [1, 2], first_token=3)  # no decode side ever posts room 8
    decode.expect(9, "127.0.0.1", port, [4])  # and this engine never prefills room 9
    sent, arrived = run_until(prefill, decode, want=2)
    assert [(r.room, r.ok) for r in sent] == [(8, False)] and "within 0.3 s" in sent[0].error
    assert [(r.room, r.ok) for r in arrived] == [(9, False)] and "did not arrive" in arrived[0].error


def test_a_decode_pool_of_another_shape_is_refused_with_the_reason(pair):
    _, _, prefill, decode, port = pair(decode_kv_heads=4)
    decode.expect(5, "127.0.0.1", port, [1])
    _, arrived = run_until(prefill, decode, want=1)
    assert not arrived[0].ok and "KV pools differ" in arrived[0].error


def test_an_unreachable_prefill_engine_fails_the_room(pair):
    _, _, prefill, decode, _ = pair()
    decode.expect(6, "127.0.0.1", 1, [1])  # nothing listens on port 1
    _, arrived = run_until(prefill, decode, want=1)
    assert not arrived[0].ok and "ConnectError" in arrived[0].error
