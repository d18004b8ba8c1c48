"""The API server's side of the engine core: starts the process and talks to it.

One asyncio task reads the output socket, runs the OutputProcessor (which turns
token ids into text and fans n>1 back in) and routes each RequestOutput to the
queue of the coroutine waiting for that request. Requests, aborts and utility
calls go out on a plain PUSH socket with no high-water mark, so sending never
blocks the event loop.

The two ipc:// sockets live in a private directory (mode 0700: no other user can
connect to them). It is removed as soon as the engine has connected to both, so
that nothing is left behind even when this process is killed with SIGKILL; a
directory left by a process killed in the seconds before that is removed by the
next start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from loraserve.engine.core_proc import run_engine_core
from loraserve.engine.protocol import EngineCoreOutputs, SchedulerStats
from loraserve.engine.utility import (
    EngineReady,
    InputKind,
    OutputDecoder,
    OutputKind,
    UtilityCall,
    UtilityResult,
    encode,
)
from loraserve.lora.request import LoRARequest
from loraserve.metrics import ServerMetrics
from loraserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from loraserve.config import EngineConfig

logger = logging.getLogger(__name__)

# The socket directory's name: this prefix, the owning process id, a random part.
IPC_DIR_PREFIX = "loraserve-ipc-"


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing can be served until a restart."""

    def __init__(self, message: str = "The engine is not running.") -> None:
        super().__init__(message)


class EngineStartError(RuntimeError):
    """The engine-core process failed to start; the message says why."""


class EngineUtilityError(RuntimeError):
    """A utility call raised in the engine; error_type is the exception's class name."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


class AsyncEngineClient:
    """Starts, feeds and stops one engine-core process."""

    def __init__(
        self, tokenizer: Any, eos_token_id: int | None, metrics: ServerMetrics | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.metrics = metrics
        self.ready_info: EngineReady | None = None
        self.latest_stats = SchedulerStats()
        self.dead = asyncio.Event()
        self._shutting_down = False
        remove_stale_ipc_dirs()
        self._ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-")
        self._input_addr = f"ipc://{self._ipc_dir}/input"
        self._output_addr = f"ipc://{self._ipc_dir}/output"
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._output = self._async_ctx.socket(zmq.PULL)
        for sock in (self._input, self._output):
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
        self._input.bind(self._input_addr)
        self._output.bind(self._output_addr)
        # Until the engine has connected to a socket, that socket's file is needed.
        self._awaiting_connect = {
            sock: _accept_monitor(sock, name)
            for sock, name in ((self._input, "input"), (self._output, "output"))
        }
        self._decoder = OutputDecoder()
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._output_task: asyncio.Task | None = None
        self._processor: Any = None

    # -- life cycle ---------------------------------------------------------------

    async def start(self, config: EngineConfig, timeout_s: float) -> EngineReady:
        """Start the engine process and wait until it has loaded the model."""
        from loraserve.engine.output_processor import OutputProcessor

        self._processor = OutputProcessor(self.tokenizer)
        # spawn, not fork: the parent may already hold threads (tokenizers, asyncio).
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=run_engine_core,
            args=(config, self._input_addr, self._output_addr, os.getpid()),
            name="loraserve-engine-core",
        )
        self._proc.start()
        self.ready_info = await self._wait_ready(timeout_s)
        loop = asyncio.get_running_loop()
        loop.add_reader(self._proc.sentinel, self._on_engine_exit)
        self._output_task = asyncio.create_task(self._output_loop(), name="engine-outputs")
        return self.ready_info

    async def _wait_ready(self, timeout_s: float) -> EngineReady:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._remove_ipc_dir_once_connected()
            if await self._output.poll(200):
                kind, payload = self._decoder.decode(await self._output.recv_multipart())
                if kind is OutputKind.READY:
                    self._remove_ipc_dir_once_connected()
                    return payload
                if kind is OutputKind.FAILED:
                    raise EngineStartError(payload.error)
            elif not self._proc.is_alive():
                raise EngineStartError(
                    f"the engine process exited with code {self._proc.exitcode} while starting"
                )
        raise EngineStartError(f"the engine did not become ready within {timeout_s:.0f} s")

    def _remove_ipc_dir_once_connected(self) -> None:
        for sock, monitor in list(self._awaiting_connect.items()):
            while monitor.poll(0):
                if recv_monitor_message(monitor)["event"] == zmq.EVENT_ACCEPTED:
                    self._stop_monitoring(sock)
                    break
        if not self._awaiting_connect and self._ipc_dir is not None:
            # Connected sockets need no file: the directory can go now.
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    def _stop_monitoring(self, sock: zmq.Socket) -> None:
        monitor = self._awaiting_connect.pop(sock)
        sock.disable_monitor()
        monitor.close(linger=0)

    @property
    def engine_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    @property
    def is_dead(self) -> bool:
        return self.dead.is_set()

    def _on_engine_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        self._mark_dead()

    def _mark_dead(self) -> None:
        if self.dead.is_set():
            return
        self.dead.set()
        error = EngineDeadError()
        for queue in self._queues.values():
            queue.put_nowait(error)
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(error)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine: ask politely, then SIGTERM, then SIGKILL. Idempotent."""
        if self._shutting_down:
            return
        self._shutting_down = True
        if self._proc is not None and self._proc.is_alive() and self.ready_info is not None:
            try:
                self._send(InputKind.SHUTDOWN)
            except EngineDeadError:
                pass  # already on its way out; the joins below wait for it
            await asyncio.to_thread(self._proc.join, timeout_s)
        if self._proc is not None and self._proc.is_alive():
            # Still starting (it reads no messages yet) or not listening: SIGTERM,
            # which its handler turns into a clean exit.
            self._proc.terminate()
            await asyncio.to_thread(self._proc.join, 2.0)
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 2.0)
        if self._proc is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._proc.sentinel)
            except (ValueError, OSError):
                pass
        self._mark_dead()
        if self._output_task is not None:
            self._output_task.cancel()
        for sock in list(self._awaiting_connect):
            self._stop_monitoring(sock)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    def fail_all_requests(self, error: Exception) -> None:
        """End every request in flight with `error` (raised where its outputs are
        awaited); each is then aborted in the engine. The engine keeps running."""
        for queue in self._queues.values():
            queue.put_nowait(error)

    # -- requests -----------------------------------------------------------------

    def _send(self, kind: InputKind, payload: Any = None) -> None:
        try:
            self._input.send_multipart(encode(kind, payload), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            # With no high-water mark, a send only fails when no engine is connected:
            # it has exited (for example Ctrl-C reached the whole process group).
            raise EngineDeadError() from None

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncIterator[Any]:
        """Yield RequestOutputs until the request finishes; aborts it if abandoned."""
        if self.is_dead:
            raise EngineDeadError()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            engine_requests = self._processor.add_request(
                request_id,
                prompt,
                prompt_token_ids,
                params,
                lora_request,
                self.eos_token_id,
                priority,
            )
            for engine_request in engine_requests:
                self._send(InputKind.ADD, engine_request)
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and self._processor is not None and not self.is_dead:
                self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Abort a request (all its n>1 children) in the engine and free its blocks."""
        child_ids = self._processor.abort_request(request_id)
        if child_ids and not self.is_dead:
            try:
                self._send(InputKind.ABORT, list(child_ids))
            except EngineDeadError:
                pass  # nothing left to abort

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 300.0) -> Any:
        """Call an allow-listed EngineCore method in the engine process."""
        if self.is_dead:
            raise EngineDeadError()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        try:
            self._send(InputKind.UTILITY, UtilityCall(call_id, method, list(args)))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._utility_futures.pop(call_id, None)

    async def add_lora(self, lora_request: LoRARequest, pinned: bool = False) -> None:
        await self.call_utility("add_lora", lora_request, pinned)

    async def remove_lora(self, lora_name: str) -> bool:
        return bool(await self.call_utility("remove_lora", lora_name))

    async def list_loras(self) -> list[str]:
        return list(await self.call_utility("list_loras"))

    async def lora_memory_usage(self) -> dict[str, int]:
        """Bytes of adapter weights in the engine's CPU cache, per adapter name."""
        return dict(await self.call_utility("lora_memory_usage"))

    async def get_stats(self) -> SchedulerStats:
        return msgspec.convert(await self.call_utility("get_stats"), SchedulerStats)

    # -- the output task ----------------------------------------------------------

    async def _output_loop(self) -> None:
        while True:
            frames = await self._output.recv_multipart()
            try:
                kind, payload = self._decoder.decode(frames)
                if kind is OutputKind.OUTPUTS:
                    self._handle_outputs(payload)
                elif kind is OutputKind.UTILITY_RESULT:
                    self._handle_utility_result(payload)
            except Exception:  # noqa: BLE001 - one bad message must not stop the loop
                logger.exception("failed to handle a message from the engine core")

    def _handle_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.outputs:
            processed = self._processor.process_outputs(outputs.outputs, outputs.timestamp)
            if self.metrics is not None:
                self.metrics.record_iteration(processed.stats)
            for request_output in processed.request_outputs:
                queue = self._queues.get(request_output.request_id)
                if queue is not None:
                    queue.put_nowait(_snapshot(request_output))
            if processed.reqs_to_abort:
                try:
                    self._send(InputKind.ABORT, list(processed.reqs_to_abort))
                except EngineDeadError:
                    pass
        if outputs.stats is not None:
            self.latest_stats = outputs.stats
            if self.metrics is not None:
                self.metrics.record_stats(outputs.stats)

    def _handle_utility_result(self, result: UtilityResult) -> None:
        future = self._utility_futures.get(result.call_id)
        if future is None or future.done():
            return
        if result.error is not None:
            future.set_exception(EngineUtilityError(result.error_type or "Error", result.error))
        else:
            future.set_result(result.result)


def _accept_monitor(sock: zmq.Socket, name: str) -> zmq.Socket:
    """A plain PAIR socket that receives the connect events of `sock` (which may be
    an asyncio socket: the monitor shares its context, not its flavour)."""
    address = f"inproc://loraserve-{name}-connects-{id(sock)}"
    sock.monitor(address, zmq.EVENT_ACCEPTED)
    monitor = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
    monitor.connect(address)
    return monitor


def remove_stale_ipc_dirs(root: str | None = None) -> None:
    """Remove the socket directories of our own loraserve processes that are gone
    (killed before they could remove them)."""
    for path in Path(root or tempfile.gettempdir()).glob(f"{IPC_DIR_PREFIX}*"):
        pid = path.name.removeprefix(IPC_DIR_PREFIX).split("-", 1)[0]
        try:
            if not pid.isdigit() or path.stat().st_uid != os.getuid() or _alive(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _snapshot(output: Any) -> Any:
    """A copy that the next process_outputs call cannot change.

    The OutputProcessor reuses one RequestOutput per request and resets its deltas
    every step; a consumer that has not run yet must still see this step's deltas.
    Lists that only grow (token_ids, logprobs) are shared, which is safe because
    a consumer reads them only from the final, finished output.
    """
    return dataclasses.replace(
        output, outputs=[dataclasses.replace(o) for o in output.outputs]
    )
