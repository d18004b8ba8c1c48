"""Framing of the messages on the two ZMQ sockets between front end and engine core.

Every message is two frames: a one-byte kind and a msgpack payload. The kind says
which struct the payload decodes to, so each side decodes with a typed decoder
and never has to guess.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from loraserve.engine.protocol import EngineCoreOutputs, EngineCoreRequest


class InputKind(enum.IntEnum):
    """Front end → engine core."""

    ADD = 0  # payload: EngineCoreRequest
    ABORT = 1  # payload: list[str] of request ids
    UTILITY = 2  # payload: UtilityCall
    SHUTDOWN = 3  # payload: empty


class OutputKind(enum.IntEnum):
    """Engine core → front end."""

    OUTPUTS = 0  # payload: EngineCoreOutputs
    UTILITY_RESULT = 1  # payload: UtilityResult
    READY = 2  # payload: EngineReady
    FAILED = 3  # payload: EngineFailed (start-up failed; the process exits next)


class UtilityCall(msgspec.Struct, array_like=True):
    """Calls one allow-listed EngineCore method; the answer carries the same call_id."""

    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    # Set when the call raised: the exception's class name and message.
    error_type: str | None = None
    error: str | None = None


class EngineReady(msgspec.Struct, omit_defaults=True):
    pid: int
    max_model_len: int
    model_path: str
    # The KV cache's size in blocks, decided as the engine started.
    num_kv_blocks: int = 0
    # The device slots (--max-loras, decided at start-up with auto); 0 without LoRA.
    max_loras: int = 0


class EngineFailed(msgspec.Struct):
    error: str


_encoder = msgspec.msgpack.Encoder()


def encode(kind: enum.IntEnum, payload: Any = None) -> list[bytes]:
    """Frames for one message."""
    return [bytes([int(kind)]), _encoder.encode(payload)]


class InputDecoder:
    """Decodes the engine core's incoming frames into (kind, payload)."""

    def __init__(self) -> None:
        self._add = msgspec.msgpack.Decoder(EngineCoreRequest)
        self._abort = msgspec.msgpack.Decoder(list[str])
        self._utility = msgspec.msgpack.Decoder(UtilityCall)

    def decode(self, frames: list[bytes]) -> tuple[InputKind, Any]:
        kind = InputKind(frames[0][0])
        if kind is InputKind.ADD:
            return kind, self._add.decode(frames[1])
        if kind is InputKind.ABORT:
            return kind, self._abort.decode(frames[1])
        if kind is InputKind.UTILITY:
            return kind, self._utility.decode(frames[1])
        return kind, None


class OutputDecoder:
    """Decodes the front end's incoming frames into (kind, payload)."""

    def __init__(self) -> None:
        self._decoders: dict[OutputKind, msgspec.msgpack.Decoder] = {
            OutputKind.OUTPUTS: msgspec.msgpack.Decoder(EngineCoreOutputs),
            OutputKind.UTILITY_RESULT: msgspec.msgpack.Decoder(UtilityResult),
            OutputKind.READY: msgspec.msgpack.Decoder(EngineReady),
            OutputKind.FAILED: msgspec.msgpack.Decoder(EngineFailed),
        }

    def decode(self, frames: list[bytes]) -> tuple[OutputKind, Any]:
        kind = OutputKind(frames[0][0])
        return kind, self._decoders[kind].decode(frames[1])
