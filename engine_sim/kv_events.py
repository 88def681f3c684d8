"""KV cache events as vLLM publishes them (`--kv-events-config` with `"publisher": "zmq"`).

A PUB socket sends multipart messages (topic, 8-byte big-endian sequence number, msgpack batch); the batch is
the array `[ts, events]`, each event a map tagged by `type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`)
with vLLM's field names. A ROUTER socket on the replay address answers `["", start]` with every kept batch from
`start` on (`["", topic, seq, payload]` each, as vLLM 0.32 does), then `["", "", -1, ""]`. The last
`buffer_steps` batches are kept.

Sends happen on the caller's thread (the engine's loop; PUB never blocks, ZMQ drops past its high-water mark);
the replay socket is served by a thread of its own.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from itertools import count

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def block_hash_int(h: bytes) -> int:
    """The simulator's block digest as vLLM's default int block hash (the digest's low 64 bits)."""
    return int.from_bytes(h[-8:], "big")


class KvEventPublisher:
    def __init__(self, config: dict):
        self.ctx = zmq.Context()
        self.topic = str(config.get("topic") or "").encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=int(config.get("buffer_steps") or 10_000))
        self.seqs = count()
        self.encode = msgspec.msgpack.Encoder().encode
        self.stopping = threading.Event()
        self.replay = None
        self.thread = None
        self.published = 0
        try:
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.bind(config.get("endpoint") or "tcp://*:5557")
            if config.get("replay_endpoint"):
                self.replay = self.ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(config["replay_endpoint"])
        except BaseException:
            # A context left to the garbage collector with a socket that failed to bind blocks in term() forever.
            self.ctx.destroy(linger=0)
            raise
        if self.replay is not None:
            self.thread = threading.Thread(target=self._serve_replay, name="kv-replay", daemon=True)
            self.thread.start()

    def publish(self, events: list[dict]) -> None:
        if not events:
            return
        seq = next(self.seqs)
        payload = self.encode([time.time(), events])
        self.buffer.append((seq, payload))
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        self.published += 1

    def _serve_replay(self) -> None:
        sock = self.replay
        while not self.stopping.is_set():
            if not sock.poll(100):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    sock.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            sock.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=1.0)
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
        self.ctx.term()


def stored(hashes: list[bytes], ids: list[int], start: int, end: int, block_size: int, salt: str | None) -> dict:
    """BlockStored for blocks start..end-1 of a prompt (its parent the block before, if any). Its `extra_keys`
    has one entry per block, as vLLM 0.32 publishes them: the prompt's cache salt in the first block's, None
    for a block without extra keys."""
    extra: list[list[str] | None] = [None] * (end - start)
    if salt and start == 0:
        extra[0] = [salt]
    return {
        "type": "BlockStored",
        "block_hashes": [block_hash_int(h) for h in hashes[start:end]],
        "parent_block_hash": block_hash_int(hashes[start - 1]) if start else None,
        "token_ids": ids[start * block_size : end * block_size],
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": extra,
    }


def removed(hashes: list[bytes]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [block_hash_int(h) for h in hashes], "medium": "GPU"}


CLEARED = {"type": "AllBlocksCleared"}
