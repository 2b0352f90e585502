import json
import socket
import struct

import pytest
from looseleaf_worker import protocol
from looseleaf_worker.protocol import ProtocolError


def pair():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    return a, b


def test_frame_round_trip():
    a, b = pair()
    msg = {"type": "run", "exec_id": "e", "cell_id": "c", "code": "print('é')"}
    protocol.send(a, msg)
    assert protocol.recv(b) == msg
    a.close()
    assert protocol.recv(b) is None  # clean EOF between frames


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"\xff\xfe",
        b"[1, 2]",
        json.dumps({"type": "nope"}).encode(),
        json.dumps({"type": "run", "exec_id": "e", "cell_id": "c"}).encode(),  # missing code
        json.dumps({"type": "started", "exec_id": "e", "unix_ms": 1.5, "execution_count": 1}).encode(),
        json.dumps({"type": "forked", "worker_id": "w", "pid": True}).encode(),  # bool is not int
        json.dumps(
            {
                "type": "restore",
                "shm_path": None,
                "variables": {"x": {"oid": 1, "version": "v", "module": None}},
                "objects": {},
                "ambient": None,
                "imports": [],
                "drop": [],
            }
        ).encode(),
        json.dumps({"type": "output", "exec_id": "e", "output": {"output_type": "stream", "name": "stdout"}}).encode(),
    ],
)
def test_malformed_frames_raise(body):
    a, b = pair()
    a.sendall(struct.pack(">I", len(body)) + body)
    with pytest.raises(ProtocolError):
        protocol.recv(b)


def test_oversized_and_truncated_frames():
    a, b = pair()
    a.sendall(struct.pack(">I", protocol.MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.recv(b)
    a, b = pair()
    a.sendall(struct.pack(">I", 100) + b"{")
    a.close()
    with pytest.raises(ProtocolError, match="closed"):
        protocol.recv(b)


def test_send_refuses_invalid_message():
    a, _ = pair()
    with pytest.raises(ProtocolError):
        protocol.send(a, {"type": "finished", "exec_id": "e"})


def test_optional_and_nested_types_checked():
    protocol.validate({"type": "hello", "role": "worker", "id": "w", "pid": 1, "zygote_id": "z"})
    with pytest.raises(ProtocolError):
        protocol.validate({"type": "hello", "role": "worker", "id": "w", "pid": 1, "cuda_unsafe": "x"})
    delta = {
        "variables": {"a": {"oid": "o", "module": None, "global_reads": []}},
        "deleted": [],
        "objects": {
            "o": {"record": {"len": 3, "chunks": ["h"]}, "refs": [], "payloads": [], "modules": [], "on_gpu": False}
        },
        "unsavable": {},
        "ambient": None,
    }
    msg = {
        "type": "save_ready",
        "exec_id": "e",
        "shm_path": None,
        "chunks": {"h": [0, 3]},
        "delta": delta,
        "save_ms": 1,
    }
    protocol.validate(msg)
    delta["objects"]["o"]["payloads"] = [{"len": 1, "chunks": []}]  # no dtype/shape/device
    with pytest.raises(ProtocolError, match="dtype"):
        protocol.validate(msg)


def test_every_message_the_runtime_sends_validates(host, zygote):
    """Drive every exchange once, then check each received message against the
    contract (recv validates; re-validate to be explicit) and that every kind the
    runtime can send was seen."""
    w = zygote.fork()
    w.run("x = 1\nx")
    w.run("print('p'); 1/0")
    w.save()
    w2 = zygote.fork()
    w2.restore(["x"])
    w2.conn.send({"type": "fork", "worker_id": "q", "env": {}, "cwd": "/", "socket": "/nope"})
    err = w2.conn.expect("error")
    assert "does not handle fork" in err["message"]
    assert w2.run("x + 1")["outputs"][0]["data"]["text/plain"] == "2"  # still serving
    seen = set()
    for msg in host.received:
        protocol.validate(msg)
        seen.add(msg["type"])
    assert {"hello", "forked", "started", "output", "finished", "save_plan", "save_ready", "restored", "error"} <= seen
