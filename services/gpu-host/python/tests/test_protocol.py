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
        json.dumps(
            {"type": "output", "exec_id": "e", "output": {"output_type": "stream", "name": "stdout", "text": ""}}
        ).encode(),  # no such frame now
        json.dumps(
            {"type": "cell_message", "exec_id": "e", "message": {"output": {"output_type": "stream", "name": "stdout"}}}
        ).encode(),  # a stream without text
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
    # the side channels: pager text, user_expressions, comm messages (in a comm answer)
    w2.run("x?", user_expressions={"n": "x"})
    answer = w2.comm("comm_open", {"comm_id": "abc", "target_name": "no.such.target", "data": {}})
    assert [protocol.message_kind(m) for m in answer["messages"]] == ["comm"]
    seen, kinds = set(), set()
    for msg in host.received:
        protocol.validate(msg)
        seen.add(msg["type"])
        if msg["type"] == "cell_message":
            kinds.add(protocol.message_kind(msg["message"]))
        elif msg["type"] == "comm_answer":
            kinds.update(protocol.message_kind(m) for m in msg["messages"])
    assert {
        "hello",
        "forked",
        "started",
        "cell_message",
        "finished",
        "save_plan",
        "save_ready",
        "restored",
        "error",
        "comm_answer",
    } <= seen
    assert "output" not in seen  # the old frame
    assert kinds == set(protocol.CELL_MESSAGE_KINDS)


# ------------------------------------------------------------- cell messages

STREAM = {"output_type": "stream", "name": "stdout", "text": "hi\n"}
COMM = {
    "msg_type": "comm_msg",
    "content": {"comm_id": "c", "data": {"method": "update", "state": {"value": 1}}},
    "metadata": {},
    "buffers": ["AAEC"],
}


def cell_message(message) -> dict:
    return {"type": "cell_message", "exec_id": "e", "message": message}


@pytest.mark.parametrize(
    "message",
    [
        {"output": STREAM},
        {"output": {"output_type": "display_data", "data": {"text/plain": "1"}, "metadata": {}}},
        {"output": {"output_type": "execute_result", "data": {}, "metadata": {}, "execution_count": 3}},
        {"output": {"output_type": "error", "ename": "E", "evalue": "v", "traceback": ["t"]}},
        {"output": {"output_type": "update_display_data", "data": {}, "metadata": {}, "transient": {}}},
        {"output": {"output_type": "clear_output", "wait": False}},
        {"comm": COMM},
        {"comm": dict(COMM, msg_type="comm_open", buffers=[])},
        {"comm": dict(COMM, msg_type="comm_close")},
        {"pager": {"data": {"text/plain": "Type: int"}, "start": 0}},
        {"user_expressions": {"data": {"n": {"status": "ok", "data": {"text/plain": "3"}, "metadata": {}}}}},
    ],
    ids=lambda m: next(iter(m)) + ("." + m["output"]["output_type"] if "output" in m else ""),
)
def test_a_cell_message_of_each_kind_validates(message):
    protocol.validate(cell_message(message))
    # and through a frame, as the host reads it
    a, b = pair()
    protocol.send(a, cell_message(message))
    assert protocol.recv(b)["message"] == message
    # a comm answer carries them too
    protocol.validate({"type": "comm_answer", "reply": {}, "messages": [message]})


@pytest.mark.parametrize(
    "message, problem",
    [
        ({"output": STREAM, "comm": COMM}, r"exactly one key .* got 2: \['comm', 'output'\]"),
        ({}, r"exactly one key .* got 0"),
        ({"stream": STREAM}, r"unknown CellMessage kind 'stream'"),
        ({"input_request": {"prompt": "?", "password": False}}, r"unknown CellMessage kind 'input_request'"),
        ({"comm": {k: v for k, v in COMM.items() if k != "content"}}, r"message\.comm: a comm message lacks 'content'"),
        ({"comm": dict(COMM, buffers=[1])}, r"message\.comm\.buffers\[0\]: expected str"),
        ({"comm": dict(COMM, msg_type="comm_info_reply")}, r"'comm_info_reply' is not one of comm_open"),
        ({"comm": "comm_msg"}, r"message\.comm: expected a comm message object, got str"),
        ({"pager": {"data": {"text/plain": "x"}}}, r"message\.pager: a pager message lacks 'start'"),
        ({"pager": {"data": "x", "start": 0}}, r"message\.pager\.data: expected an object"),
        ({"user_expressions": {}}, r"message\.user_expressions: a user_expressions message lacks 'data'"),
        (
            {"output": {"output_type": "comm", **COMM}},
            r"message\.output: output_type 'comm' is not a notebook output \(a comm message is a CellMessage",
        ),
        (
            {"output": {"output_type": "pager", "data": {"text/plain": "x"}, "start": 0}},
            r"message\.output: output_type 'pager' is not a notebook output \(pager text is a CellMessage",
        ),
        (
            {"output": {"output_type": "user_expressions", "data": {}}},
            r"output_type 'user_expressions' is not a notebook output",
        ),
        (
            {"output": {"output_type": "input_request", "prompt": "?", "password": False}},
            r"output_type 'input_request' is not a notebook output \(an input request is the 'input_request' frame\)",
        ),
        ({"output": {"output_type": "stream", "name": "stdout"}}, r"message\.output: a stream output lacks 'text'"),
        ({"output": ["stream"]}, r"message\.output: expected an nbformat output object, got list"),
        ("output", r"cell_message\.message: expected a CellMessage object, got str"),
    ],
)
def test_a_malformed_cell_message_is_refused_naming_the_problem(message, problem):
    with pytest.raises(ProtocolError, match=problem):
        protocol.validate(cell_message(message))
    with pytest.raises(ProtocolError, match=r"comm_answer\.messages\[0\]"):
        protocol.validate({"type": "comm_answer", "reply": {}, "messages": [message]})


def test_the_old_frames_are_refused():
    with pytest.raises(ProtocolError, match="unknown message type 'output'"):
        protocol.validate({"type": "output", "exec_id": "e", "output": STREAM})
    with pytest.raises(ProtocolError, match=r"comm_answer: missing field 'messages'"):
        protocol.validate({"type": "comm_answer", "reply": {}, "outputs": [{"output": STREAM}]})
    with pytest.raises(ProtocolError, match=r"cell_message: missing field 'message'"):
        protocol.validate({"type": "cell_message", "exec_id": "e", "output": STREAM})
