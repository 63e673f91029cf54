"""What one room post costs a prefill engine's bootstrap server, by the number of rooms it
remembers (a room is remembered for twice --disaggregation-timeout, 120 s by default: at a few
hundred rooms a second, tens of thousands). The server runs in this process; a decode engine is
registered and posts rooms as fast as it can; no KV moves and nothing else runs.

    python benchmarks/bootstrap_posts.py --out benchmarks/results/bootstrap_posts.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import kubesgl
from kubesgl.engine.disagg.bootstrap_server import BootstrapServer
from kubesgl.engine.disagg.protocol import (
    PeerConnected,
    PeerRegistered,
    PeerRegistration,
    PoolLayout,
    RankAgent,
    RoomPostBody,
    ServeBootstrap,
)


def stand_in_layout(agent: str) -> PoolLayout:
    """A pool of 8 slots of one layer at made-up addresses: what a bootstrap server is given
    where no KV moves."""
    return PoolLayout(
        agent=agent,
        memory="DRAM",
        device_id=0,
        slot_bytes=16,
        slot_shape=(2, 4),
        dtype="float16",
        num_slots=8,
        k_addresses=(1000,),
        v_addresses=(2000,),
    )


LAYOUT = stand_in_layout("prefill")
DECODE = "decode-0"


def registered_server() -> BootstrapServer:
    """A server whose scheduler side accepts every decode engine at once."""
    servers: list[BootstrapServer] = []

    def emit(fact: object) -> None:
        if isinstance(fact, PeerRegistered):  # answered from a thread, as the scheduler does
            connected = PeerConnected(fact.engine, None)
            threading.Thread(target=servers[0].peer_connected, args=(connected,)).start()

    server = BootstrapServer(emit, ServeBootstrap(LAYOUT, 1, "127.0.0.1", 0, 60.0))
    servers.append(server)
    agent = RankAgent(b"decode-agent", stand_in_layout(DECODE))
    assert server.register(PeerRegistration(DECODE, (agent,)))[0] == 200
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--remembered", default="1000,10000,30000")
    parser.add_argument("--posts", type=int, default=200, help="timed posts at each size")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    server = registered_server()
    room = 0

    def post() -> None:
        nonlocal room
        room += 1
        assert server.post_room(RoomPostBody(room, DECODE, (0,)))[0] == 200

    while True:  # the registration completes on another thread
        room += 1
        if server.post_room(RoomPostBody(room, DECODE, (0,)))[0] == 200:
            break
        time.sleep(0.01)
    ms_per_post = {}
    for remembered in map(int, args.remembered.split(",")):
        while len(server._rooms) < remembered:
            post()
        began = time.perf_counter()
        for _ in range(args.posts):
            post()
        ms_per_post[remembered] = round((time.perf_counter() - began) / args.posts * 1e3, 4)
    server.close()
    result = {"kubesgl": kubesgl.__version__, "posts": args.posts, "ms_per_post": ms_per_post}
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
