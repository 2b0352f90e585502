"""Frames and the message contract shared with the Rust gpu-host.

A frame is a 4-byte big-endian length followed by UTF-8 JSON (one object with
"type"). The contract lives in ``worker-protocol.json`` beside this module (shipped in the package)
and is read here at import so that Python and Rust can never disagree about
field names: every message we send or receive is checked against it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
from pathlib import Path
from typing import Any

_DEFAULT_FILE = Path(__file__).resolve().parent / "worker-protocol.json"


class ProtocolError(Exception):
    """A frame or message that breaks the contract (bad length, bad JSON, missing
    or mistyped field, unknown type), or a peer that went away mid-frame."""


def _load_contract() -> dict:
    path = Path(os.environ.get("LOOSELEAF_PROTOCOL_FILE") or _DEFAULT_FILE)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


CONTRACT: dict = _load_contract()
# which contract: the host refuses a runtime of another version at its start
VERSION: int = int(CONTRACT["version"])
MAX_FRAME_BYTES: int = int(CONTRACT["max_frame_bytes"])
CHUNK_SIZE: int = int(CONTRACT["chunk"]["size"])
MESSAGES: dict = CONTRACT["messages"]
TYPES: dict = CONTRACT["types"]

_HEADER = struct.Struct(">I")
# "dict[str,DeltaVar]: every name ..." -> the type is what precedes ": ".
_TYPE_PREFIX = re.compile(r"^([A-Za-z_\[\],|]+)(?::\s|$)")


# ---------------------------------------------------------------- validation


def _split_top(s: str, sep: str) -> list[str]:
    """Split on ``sep`` outside brackets (for unions and dict parameters)."""
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == sep and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [p.strip() for p in out]


def _check(value: Any, ty: str, where: str) -> None:
    ty = ty.strip()
    alts = _split_top(ty, "|")
    if len(alts) > 1:
        errors = []
        for alt in alts:
            try:
                _check(value, alt, where)
                return
            except ProtocolError as e:
                errors.append(str(e))
        raise ProtocolError(f"{where}: {value!r:.80} is none of {ty}")
    if ty == "null":
        if value is not None:
            raise ProtocolError(f"{where}: expected null")
        return
    if ty == "any":  # JSON the contract does not constrain (a Jupyter reply's content)
        return
    if ty == "str":
        ok = isinstance(value, str)
    elif ty == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif ty == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif ty == "bool":
        ok = isinstance(value, bool)
    elif ty.startswith("list[") and ty.endswith("]"):
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected {ty}, got {type(value).__name__}")
        for i, v in enumerate(value):
            _check(v, ty[5:-1], f"{where}[{i}]")
        return
    elif ty.startswith("dict[") and ty.endswith("]"):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected {ty}, got {type(value).__name__}")
        _, vty = _split_top(ty[5:-1], ",")
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError(f"{where}: non-string key {k!r}")
            _check(v, vty, f"{where}.{k}")
        return
    elif ty == "Region":
        ok = (
            isinstance(value, list)
            and len(value) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)
        )
    elif ty == "NbOutput":
        _check_output(value, where)
        return
    elif ty == "CellMessage":
        _check_cell_message(value, where)
        return
    elif ty in TYPES:
        spec = TYPES[ty]
        if not isinstance(spec, dict):
            raise ProtocolError(f"{where}: no checker for type {ty}")
        _check_fields(value, spec, {}, where)
        return
    else:
        raise ProtocolError(f"{where}: unknown type {ty!r} in contract")
    if not ok:
        raise ProtocolError(f"{where}: expected {ty}, got {type(value).__name__}")


def _field_type(spec: str) -> str:
    m = _TYPE_PREFIX.match(spec)
    return m.group(1) if m else spec


def _check_fields(obj: Any, fields: dict, optional: dict, where: str) -> None:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where}: expected an object")
    for name, spec in fields.items():
        if name not in obj:
            raise ProtocolError(f"{where}: missing field {name!r}")
        _check(obj[name], _field_type(spec), f"{where}.{name}")
    for name, spec in optional.items():
        if name in obj:
            _check(obj[name], _field_type(spec), f"{where}.{name}")


# An nbformat output, or a Jupyter message that changes the outputs shown.
_OUTPUT_FIELDS = {
    "stream": {"name": "str", "text": "str"},
    "display_data": {"data": "dict", "metadata": "dict"},
    "execute_result": {"data": "dict", "metadata": "dict", "execution_count": "int"},
    "error": {"ename": "str", "evalue": "str", "traceback": "list[str]"},
    "update_display_data": {"data": "dict", "metadata": "dict"},
    "clear_output": {"wait": "bool"},
}

# What a request sends its client (a CellMessage): one key names the kind. An
# ``output`` is an NbOutput; the others are channels Jupyter keeps apart from a
# notebook's outputs.
CELL_MESSAGE_KINDS = ("output", "comm", "pager", "user_expressions")
_SIDE_CHANNEL_FIELDS = {
    # a comm message to the client (ipywidgets)
    "comm": {"msg_type": "str", "content": "dict", "metadata": "dict", "buffers": "list[str]"},
    # the text of obj?, for a Jupyter pager (execute_reply's payload)
    "pager": {"data": "dict", "start": "int"},
    # the results of the run's user_expressions, for the client's execute_reply
    "user_expressions": {"data": "dict"},
}
_COMM_MSG_TYPES = ("comm_open", "comm_msg", "comm_close")

# Kinds that once travelled as outputs: named in the error, to point at their place now.
_NOT_OUTPUTS = {
    "comm": "a comm message is a CellMessage of kind 'comm'",
    "pager": "pager text is a CellMessage of kind 'pager'",
    "user_expressions": "user_expressions results are a CellMessage of kind 'user_expressions'",
    "input_request": "an input request is the 'input_request' frame",
}


def message_kind(message: dict) -> str:
    """The kind of a CellMessage (its one key): output, comm, pager or user_expressions."""
    (kind,) = message
    return kind


def _check_body(body: Any, fields: dict, what: str, where: str) -> None:
    """The fields of an output or side-channel message (``dict``: any object)."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: expected {what} object, got {type(body).__name__}")
    for name, ty in fields.items():
        if name not in body:
            raise ProtocolError(f"{where}: {what} lacks {name!r}")
        if ty == "dict":
            if not isinstance(body[name], dict):
                raise ProtocolError(f"{where}.{name}: expected an object, got {type(body[name]).__name__}")
        else:
            _check(body[name], ty, f"{where}.{name}")


def _check_output(out: Any, where: str) -> None:
    if not isinstance(out, dict):
        raise ProtocolError(f"{where}: expected an nbformat output object, got {type(out).__name__}")
    kind = out.get("output_type")
    if kind not in _OUTPUT_FIELDS:
        why = f" ({_NOT_OUTPUTS[kind]})" if kind in _NOT_OUTPUTS else ""
        raise ProtocolError(f"{where}: output_type {kind!r} is not a notebook output{why}")
    _check_body(out, _OUTPUT_FIELDS[kind], f"a {kind} output", where)


def _check_cell_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise ProtocolError(f"{where}: expected a CellMessage object, got {type(message).__name__}")
    if len(message) != 1:
        raise ProtocolError(
            f"{where}: a CellMessage has exactly one key naming its kind ({' | '.join(CELL_MESSAGE_KINDS)}),"
            f" got {len(message)}: {sorted(map(str, message))}"
        )
    ((kind, body),) = message.items()
    if kind not in CELL_MESSAGE_KINDS:
        raise ProtocolError(f"{where}: unknown CellMessage kind {kind!r} (not {' | '.join(CELL_MESSAGE_KINDS)})")
    if kind == "output":
        _check_output(body, f"{where}.output")
        return
    _check_body(body, _SIDE_CHANNEL_FIELDS[kind], f"a {kind} message", f"{where}.{kind}")
    if kind == "comm" and body["msg_type"] not in _COMM_MSG_TYPES:
        raise ProtocolError(f"{where}.comm.msg_type: {body['msg_type']!r} is not one of {' | '.join(_COMM_MSG_TYPES)}")


def validate(msg: Any) -> dict:
    """Raise ProtocolError unless ``msg`` is a message of the contract."""
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError("message is not an object with a string 'type'")
    spec = MESSAGES.get(msg["type"])
    if spec is None:
        raise ProtocolError(f"unknown message type {msg['type']!r}")
    _check_fields(msg, spec.get("fields", {}), spec.get("optional", {}), msg["type"])
    return msg


# ------------------------------------------------------------------- framing


def encode(msg: dict) -> bytes:
    validate(msg)
    body = json.dumps(msg, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict:
    try:
        msg = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"frame is not UTF-8 JSON: {e}") from None
    return validate(msg)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            if buf:
                raise ProtocolError(f"peer closed mid-frame ({len(buf)} of {n} bytes)")
            return None
        buf += part
    return bytes(buf)


def send(sock: socket.socket, msg: dict) -> None:
    sock.sendall(encode(msg))


def recv(sock: socket.socket) -> dict | None:
    """The next message, or None on a clean EOF between frames."""
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    (n,) = _HEADER.unpack(head)
    if n > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame length {n} exceeds {MAX_FRAME_BYTES}")
    body = _recv_exact(sock, n)
    if body is None:
        raise ProtocolError("peer closed after a frame header")
    return decode(body)
