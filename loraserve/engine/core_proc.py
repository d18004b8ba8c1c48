"""The engine-core process: runs EngineCore in a loop behind two ZMQ sockets.

The API server binds both sockets and starts this process; here we connect, build
the engine, say READY, then loop: take every queued request, abort and utility
call, run one step when there is work, and push the step's outputs back. The
process exits on SHUTDOWN, SIGTERM/SIGINT, or as soon as its parent is gone; and
with status 1 when a tensor-parallel rank dies, so that the API server answers
503 as for any dead engine.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import zmq

from loraserve.distributed.parallel_state import TensorParallelError
from loraserve.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from loraserve.engine.utility import (
    EngineFailed,
    EngineReady,
    InputDecoder,
    InputKind,
    OutputKind,
    UtilityCall,
    UtilityResult,
    encode,
)
from loraserve.log import configure_logging
from loraserve.lora.request import LoRARequest

if TYPE_CHECKING:
    from loraserve.config import EngineConfig

logger = logging.getLogger(__name__)

# Only these EngineCore methods may be called from the front end.
UTILITY_METHODS = frozenset(
    {"add_lora", "remove_lora", "list_loras", "get_stats", "pin_lora", "lora_memory_usage"}
)
# Stats go out with every step that has outputs, and at least this often otherwise
# so that the metrics follow an idle engine too.
_STATS_INTERVAL_S = 0.25
_IDLE_POLL_MS = 100
# A step that produced nothing (requests waiting on an adapter load) should not spin
# a core at 100 %: wait this long for new input before the next step.
_EMPTY_STEP_POLL_MS = 2
# After a tensor-parallel rank died, the loop has this long to stop the engine
# itself before the watchdog ends the process.
_RANK_DEATH_GRACE_S = 5.0


def _use_thread_locks_for_progress_bars() -> None:
    # tqdm's default lock is a multiprocessing semaphore; os._exit at the end would
    # skip its clean-up and make the resource tracker warn about a leak.
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def watch_ranks(executor: Any) -> None:
    """End the process once a tensor-parallel rank has died and the loop did not
    stop the engine: rank 0 may wait in a collective that never returns (NCCL does
    not notice a dead peer before its timeout)."""

    def on_death(reason: str) -> None:
        logger.error("%s; the engine is stuck waiting for it, ending it", reason)
        os._exit(1)

    executor.watch(on_death, _RANK_DEATH_GRACE_S)


class _PendingAdd(NamedTuple):
    call: UtilityCall
    lora_request: LoRARequest


class RuntimeLoRALoader:
    """Runs add_lora utility calls without stalling the loop.

    The engine reads the adapter in the background (on every tensor-parallel
    rank) and commits it from the loop once the read is done; this answers each
    call when its adapter is in, or with the reason it could not be.
    """

    def __init__(self, core: Any) -> None:
        self.core = core
        self.pending: list[_PendingAdd] = []

    def submit(self, call: UtilityCall) -> bool:
        """Start an add_lora call; False when it must run inline (no LoRA)."""
        if not self.core.lora_enabled:
            return False
        lora_request = msgspec.convert(call.args[0], LoRARequest)
        pinned = bool(call.args[1]) if len(call.args) > 1 else False
        self.core.start_add_lora(lora_request, pinned)
        self.pending.append(_PendingAdd(call, lora_request))
        return True

    def drop(self, lora_name: str) -> list[UtilityResult]:
        """Give up the adds of an adapter that is being unloaded, so that none of
        them makes it resident again once the unload is done."""
        dropped = [item for item in self.pending if item.lora_request.lora_name == lora_name]
        self.pending = [item for item in self.pending if item not in dropped]
        return [UtilityResult(
            call_id=item.call.call_id, error_type="LoRAError",
            error=f"LoRA adapter {lora_name!r} was unloaded while it loaded",
        ) for item in dropped]

    def finished(self) -> list[UtilityResult]:
        """Answer the adds whose adapters are in (or failed), in submission order."""
        if not self.pending:
            return []
        ended = {request.lora_name: error for request, error in self.core.poll_lora_adds()}
        results = []
        for item in list(self.pending):
            name = item.lora_request.lora_name
            if name not in ended:
                continue
            self.pending.remove(item)
            error = ended[name]
            result = UtilityResult(call_id=item.call.call_id)
            if error is not None:
                result.error_type = type(error).__name__
                result.error = str(error) or type(error).__name__
            results.append(result)
        return results


class _Stop(BaseException):
    """Raised by the signal handler; a BaseException so no `except Exception` eats it."""


class EngineCoreProc:
    """Owns the sockets and the loop around one EngineCore."""

    def __init__(self, core: Any, in_sock: zmq.Socket, out_sock: zmq.Socket, parent_pid: int):
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.parent_pid = parent_pid
        self.decoder = InputDecoder()
        self.lora_loader = RuntimeLoRALoader(core)
        self.stop = False
        self._last_stats = 0.0
        self._was_busy = False

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.in_sock, zmq.POLLIN)
        timeout = _IDLE_POLL_MS
        while not self.stop:
            if poller.poll(timeout):
                self._drain_inputs()
            if self.stop or os.getppid() != self.parent_pid:
                return
            # A dead rank ends the engine even while no request runs.
            self.core.check_workers()
            for result in self.lora_loader.finished():
                self._send_utility_result(result)
            busy = self.core.has_unfinished_requests()
            if busy:
                outputs = self.core.step()
                self._send_outputs(outputs, force=bool(outputs.outputs))
                busy_next = outputs.outputs or self.core.has_step_in_flight
                timeout = 0 if busy_next else _EMPTY_STEP_POLL_MS
            else:
                # Going idle: report it at once so running/waiting gauges drop to 0.
                self._send_outputs(None, force=self._was_busy)
                timeout = _EMPTY_STEP_POLL_MS if self.lora_loader.pending else _IDLE_POLL_MS
            self._was_busy = busy

    def _send_outputs(self, outputs: EngineCoreOutputs | None, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats < _STATS_INTERVAL_S:
            return
        if outputs is None:
            outputs = EngineCoreOutputs()
        if outputs.stats is None:
            outputs.stats = self.core.get_stats()
        self._last_stats = now
        self.out_sock.send_multipart(encode(OutputKind.OUTPUTS, outputs), copy=False)

    def _drain_inputs(self) -> None:
        while True:
            try:
                frames = self.in_sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                kind, payload = self.decoder.decode(frames)
            except (msgspec.DecodeError, ValueError, IndexError) as exc:
                self._refuse_undecodable(frames, exc)
                continue
            if kind is InputKind.ADD:
                self._add_request(payload)
            elif kind is InputKind.ABORT:
                self.core.abort_requests(payload)
            elif kind is InputKind.UTILITY:
                self._call_utility(payload)
            elif kind is InputKind.SHUTDOWN:
                self.stop = True
                return

    def _add_request(self, request: EngineCoreRequest) -> None:
        try:
            self.core.add_request(request)
        except Exception as exc:  # noqa: BLE001 - any bad request fails alone
            # The front end is waiting on this id: answer it instead of dropping it.
            failed = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                error=str(exc) or type(exc).__name__,
            )
            self._send_outputs(EngineCoreOutputs(outputs=[failed]), force=True)

    def _refuse_undecodable(self, frames: list[bytes], exc: Exception) -> None:
        """A message that does not decode fails alone; a request among them is
        still answered when its id can be read."""
        logger.error("dropping an engine input that does not decode: %s", exc)
        try:
            kind = InputKind(frames[0][0])
            raw = msgspec.msgpack.decode(frames[1])
        except (msgspec.DecodeError, ValueError, IndexError):
            return
        if kind is InputKind.ADD and isinstance(raw, dict):
            request_id = raw.get("request_id")
            if isinstance(request_id, str):
                failed = EngineCoreOutput(
                    request_id=request_id, new_token_ids=[],
                    finish_reason=FinishReason.ERROR, error=f"invalid request: {exc}",
                )
                self._send_outputs(EngineCoreOutputs(outputs=[failed]), force=True)
        elif kind is InputKind.UTILITY and isinstance(raw, list) and raw:
            if isinstance(raw[0], int):
                self._send_utility_result(UtilityResult(
                    call_id=raw[0], error_type="ValueError", error=f"invalid call: {exc}"))

    def _send_utility_result(self, result: UtilityResult) -> None:
        self.out_sock.send_multipart(encode(OutputKind.UTILITY_RESULT, result), copy=False)

    def _call_utility(self, call: UtilityCall) -> None:
        if call.method == "add_lora" and self.lora_loader.submit(call):
            return  # answered from the loop once the adapter is read
        if call.method == "remove_lora" and call.args:
            for dropped in self.lora_loader.drop(str(call.args[0])):
                self._send_utility_result(dropped)
        result = UtilityResult(call_id=call.call_id)
        try:
            args = list(call.args)
            if call.method in UTILITY_METHODS and hasattr(self.core, call.method):
                if call.method == "add_lora":
                    args[0] = msgspec.convert(args[0], LoRARequest)
                result.result = getattr(self.core, call.method)(*args)
            else:
                raise ValueError(f"unknown engine utility method {call.method!r}")
        except Exception as exc:  # noqa: BLE001 - reported back to the caller
            result.error_type = type(exc).__name__
            result.error = str(exc) or type(exc).__name__
        self._send_utility_result(result)


def run_engine_core(
    config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int
) -> None:
    """Process entry point (multiprocessing target)."""
    # Here, not at import: the API server imports this module and needs no torch.
    from loraserve.worker.process import configure_torch_threads, die_with_parent

    die_with_parent()
    configure_logging()
    _use_thread_locks_for_progress_bars()
    # Before any torch work: the inter-op pool can only be sized before it starts.
    configure_torch_threads(share_with_frontend=True)

    def _on_signal(signum: int, frame: Any) -> None:
        raise _Stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    out_sock = ctx.socket(zmq.PUSH)
    for sock in (in_sock, out_sock):
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    in_sock.connect(input_addr)
    out_sock.connect(output_addr)
    exit_code = 0
    try:
        if os.getppid() != parent_pid:
            return
        try:
            from loraserve.engine.engine_core import EngineCore

            core = EngineCore(config)
        except Exception as exc:  # noqa: BLE001 - sent to the parent, which prints it
            traceback.print_exc()
            message = f"{type(exc).__name__}: {exc}"
            out_sock.send_multipart(encode(OutputKind.FAILED, EngineFailed(error=message)))
            exit_code = 1
            return
        ready = EngineReady(
            pid=os.getpid(),
            max_model_len=config.model_config.max_model_len,
            model_path=str(config.model_config.model),
            num_kv_blocks=core.kv.num_blocks,
            max_loras=config.lora_config.max_loras if config.lora_config else 0,
        )
        out_sock.send_multipart(encode(OutputKind.READY, ready))
        proc = EngineCoreProc(core, in_sock, out_sock, parent_pid)
        watch_ranks(core.executor)
        try:
            proc.run()
        finally:
            core.shutdown()
    except _Stop:
        pass
    except TensorParallelError as exc:
        # The reason, for the log; clients only learn that the engine is gone (503).
        logger.error("%s; stopping the engine", exc)
        exit_code = 1
    except Exception:  # noqa: BLE001 - a crash must still end the process cleanly
        traceback.print_exc()
        exit_code = 1
    finally:
        in_sock.close(linger=0)
        out_sock.close(linger=500)
        ctx.term()
        sys.stdout.flush()
        sys.stderr.flush()
        # Background adapter-loading threads must not keep a dead engine alive.
        os._exit(exit_code)
