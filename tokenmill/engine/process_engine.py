"""The engine core in a child process, behind the same front as the threaded engine.

The child owns the model, the KV cache and the step loop; this process keeps only
the tokenizer and model metadata. Commands go down one queue; each step's outputs
and a stats snapshot come back up another as one message. `time.monotonic` is
system-wide on Linux, so arrival times and deadlines mean the same on both sides.

The child never outlives this process: the kernel kills it when its parent dies
(PR_SET_PDEATHSIG), and a thread in it exits when a pipe that only the parent holds
open reaches end-of-file (the fallback where prctl is missing). If the child dies,
the reader notices within `POLL_S`, every request in flight ends with an error, and
a new child is started.

A child that stops answering (SIGSTOP, a deadlock, a machine too starved to run it) is
caught by a watchdog thread here: a thread of the child, not the one that steps,
bumps a shared counter every `HEARTBEAT_S`; when neither that counter nor a message
from the child has moved for `EngineConfig.hang_timeout_s`, the child is killed, its
requests end with `EngineHungError`, and a new child is started (one that hangs while
it loads fails the start, or the restart: the server then exits 3 for its supervisor).
A long step does not
look hung: the step releases the GIL in torch's and our fused kernels, and the native
calls that keep it (one layer's attention) last milliseconds, so the heartbeat keeps
moving; the default bound (10 s) is there for a machine so loaded that the heartbeat
thread waits seconds for a core, and is still far below any client's timeout.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.types import EngineDeadError, EngineHungError
from tokenmill.engine.front import (AbortCommand, AddCommand, EngineFront, generation_defaults, refusal, refused_error,
                                    run_commands)
from tokenmill.model.metadata import load_model_info
from tokenmill.model.snapshot import model_snapshot

log = logging.getLogger("tokenmill.engine")
_STOP = "stop"
POLL_S = 0.2  # how often the reader checks that the child is alive while it is silent
HEARTBEAT_S = 0.5  # how often a thread of the child proves that the process runs
LOAD_HANG_FACTOR = 3  # a loading child may be silent this many times the hang timeout
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int, lifeline: Any) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the lifeline below still holds
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        try:
            lifeline.recv()
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="tokenmill-lifeline", daemon=True).start()


def _beat(beat: Any) -> None:
    while True:
        beat.value += 1
        time.sleep(HEARTBEAT_S)


def _take(cmds: list, item: Any) -> None:
    """A message is one command, or the list of them the front gave in one turn."""
    if isinstance(item, list):
        cmds.extend(item)
    else:
        cmds.append(item)


def _child_main(config: EngineConfig, cmd_q: Any, out_q: Any, lifeline: Any, parent_pid: int, beat: Any) -> None:
    # (the requests it gets are resolved by the front: the child needs no generation defaults)
    _die_with_parent(parent_pid, lifeline)
    threading.Thread(target=_beat, args=(beat,), name="tokenmill-heartbeat", daemon=True).start()
    # Ctrl-C, or a service manager's SIGTERM, goes to the whole process group: the
    # parent drains its requests and then stops this child itself. Dying on the signal
    # would fail the requests being drained and have the parent restart the engine.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from tokenmill import logs

    logs.configure_from_env()
    from tokenmill.engine.encoder_engine import build_core

    try:
        engine = build_core(config)
    except BaseException as exc:
        out_q.put(("failed", repr(exc)))
        _leave(out_q, 1)
    out_q.put(("ready", engine.limits, engine.stats()))
    try:
        while True:
            cmds = []
            if not engine.has_unfinished():
                _take(cmds, cmd_q.get())  # idle: block until there is something to do
            while True:
                try:
                    _take(cmds, cmd_q.get_nowait())
                except queue.Empty:
                    break
            if _STOP in cmds:
                break
            aborted, refused = run_commands(engine, cmds)
            outputs = aborted + engine.step()
            if outputs or refused or cmds:
                out_q.put(("step", outputs, [(rid, *refusal(exc)) for rid, exc in refused], engine.stats()))
    except BaseException as exc:
        out_q.put(("failed", repr(exc)))
    finally:
        engine.close()  # flush the disk tier's writes
        _leave(out_q, 0)


def _leave(out_q: Any, code: int) -> None:
    """Exit without the interpreter's teardown: a spawned child otherwise spends ~0.5 s
    (more on a busy machine) taking torch's modules and tensors apart, memory the kernel
    frees at once, and a model swap (engine/models.py) waits for it. The queue's last
    messages are flushed first."""
    out_q.close()
    out_q.join_thread()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class _Child:
    proc: Any
    cmd_q: Any
    out_q: Any
    lifeline: Any  # the write end: the child sees end-of-file when this process dies
    beat: Any  # a shared counter the child's heartbeat thread bumps (the watchdog reads it)
    reader: threading.Thread | None = None
    closed: bool = False
    hung: bool = False  # the watchdog killed it: the reader reports nothing of its death
    last_message: float = 0.0  # when the reader last got a message from it (time.monotonic)


class ProcessEngine(EngineFront):
    def __init__(self, config: EngineConfig, launch_early: bool = True):
        self.config = config
        self._ctx = mp.get_context("spawn")  # never fork a process that holds OpenMP threads
        self._child: _Child | None = None
        self._pending: list[AddCommand | AbortCommand] = []  # given this turn of the event loop (_submit)
        # The child imports torch and loads the weights (seconds) while this process reads
        # the metadata and builds the tokenizer (up to a second for a 150K vocabulary): a
        # start costs the longer of the two, not their sum. Only from the main thread,
        # whose exit is this process's (the kernel's parent-death signal follows the
        # thread that forked); elsewhere, or for a model loaded on demand
        # (`launch_early=False`: engine/models.py), the child starts in start().
        main = threading.current_thread() is threading.main_thread()
        early = self._launch() if launch_early and main else None
        try:
            info = load_model_info(config.model.path)
            defaults = generation_defaults(info.generation, config.model)
            snapshot = model_snapshot(config, info, defaults)
        except BaseException:
            if early is not None:
                self._close(early)
                self._child = None
            raise
        super().__init__(info.tokenizer, info.config, config.bounds, config.model.served_name, defaults, snapshot,
                         config.lora.adapters)

    @property
    def running(self) -> bool:
        c = self._child
        return (c is not None and not c.closed and c.proc.is_alive() and self.error is None
                and self._limits is not None)

    @property
    def pid(self) -> int | None:
        """The engine child's process id (None before start)."""
        return self._child.proc.pid if self._child is not None else None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        await self._spawn()

    def _launch(self) -> _Child:
        ctx = self._ctx
        cmd_q, out_q = ctx.Queue(), ctx.Queue()
        theirs, ours = ctx.Pipe(duplex=False)
        beat = ctx.Value("Q", 0, lock=False)  # one writer (the child's heartbeat), one reader
        proc = ctx.Process(target=_child_main, args=(self.config, cmd_q, out_q, theirs, os.getpid(), beat),
                           name="tokenmill-engine", daemon=True)
        proc.start()  # from the main or the event loop's thread: PDEATHSIG follows the thread that forked
        theirs.close()
        child = _Child(proc, cmd_q, out_q, ours, beat)
        self._child = child
        return child

    async def _spawn(self) -> None:
        child = self._child
        if child is None or child.closed or child.reader is not None:  # none launched early, or a restart
            child = self._launch()
        msg = await asyncio.to_thread(self._first_message, child)
        if msg[0] != "ready":
            self._close(child)
            self.error = RuntimeError(f"engine process failed to start: {msg[1]}")
            raise self.error
        _, self._limits, self._stats = msg
        child.reader = threading.Thread(target=self._read, args=(child,), name="tokenmill-engine-reader",
                                        daemon=True)
        child.reader.start()
        if self.config.hang_timeout_s > 0:
            threading.Thread(target=self._watch, args=(child,), name="tokenmill-engine-watchdog",
                             daemon=True).start()

    def _first_message(self, child: _Child) -> tuple:
        # While it loads, the watchdog's bound is tripled: imports and loading hold the
        # GIL for longer stretches than a step (a library's dlopen).
        hang_s = LOAD_HANG_FACTOR * self.config.hang_timeout_s
        last_beat, alive_at = child.beat.value, time.monotonic()
        while True:
            try:
                return child.out_q.get(timeout=POLL_S)
            except queue.Empty:
                if not child.proc.is_alive():
                    return ("failed", f"exit code {child.proc.exitcode}")
                now = time.monotonic()
                if child.beat.value != last_beat:
                    last_beat, alive_at = child.beat.value, now
                elif hang_s > 0 and now - alive_at > hang_s:
                    child.proc.kill()
                    return ("failed", f"it showed no sign of life for {now - alive_at:.1f}s while loading "
                                      "(stopped or stuck)")

    async def _restart_loop(self) -> None:
        old = self._child
        if old is not None:
            await asyncio.to_thread(self._close, old)
        await self._spawn()

    async def stop(self) -> None:
        self._stopping = True
        child = self._child
        if child is None:
            return
        if child.proc.is_alive():
            self._flush()
            child.cmd_q.put(_STOP)
            await asyncio.to_thread(child.proc.join, 30)
        await asyncio.to_thread(self._close, child)

    @staticmethod
    def _close(child: _Child) -> None:
        child.closed = True
        if child.proc.is_alive():
            child.proc.kill()
        child.proc.join(5)
        child.out_q.put(None)  # wake the reader
        if child.reader is not None and child.reader is not threading.current_thread():
            child.reader.join(5)
        child.lifeline.close()
        for q in (child.cmd_q, child.out_q):
            q.close()
            q.cancel_join_thread()

    def _submit(self, cmd: AddCommand | AbortCommand) -> None:
        """Commands given in one turn of the event loop go to the child as one message, so
        the inputs of one body (a /v1/embeddings list, several prompts) reach the same step
        instead of the first arriving alone; from another thread, at once."""
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if not on_loop:
            self._flush()
            self._send(cmd)
            return
        self._pending.append(cmd)
        if len(self._pending) == 1:
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        cmds, self._pending = self._pending, []
        if cmds:
            self._send(cmds)

    def _send(self, item: Any) -> None:
        child = self._child
        if child is not None and not child.closed:
            child.cmd_q.put(item)

    def _read(self, child: _Child) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            try:
                msg = child.out_q.get(timeout=POLL_S)
            except queue.Empty:
                if child.closed or child.hung:
                    return
                if child.proc.is_alive():
                    continue
                msg = ("failed", f"the engine process exited (code {child.proc.exitcode})")
            except (EOFError, OSError):
                msg = ("failed", "the engine process's queue broke")
            if msg is None or child.closed or child.hung:
                return
            child.last_message = time.monotonic()
            if msg[0] == "failed":
                error = EngineDeadError(f"engine process failed: {msg[1]}")
                log.error("%s", error)
                loop.call_soon_threadsafe(self._on_death, error)
                return
            _, outputs, refused, stats = msg
            self._stats = stats
            for rid, *why in refused:
                loop.call_soon_threadsafe(self._fail, rid, refused_error(*why))
            if outputs:
                loop.call_soon_threadsafe(self._deliver, outputs)

    def _watch(self, child: _Child) -> None:
        """Kill a child that shows no sign of life for `hang_timeout_s` (see the module's
        docstring) and have it replaced, its requests ended with EngineHungError."""
        timeout = self.config.hang_timeout_s
        loop = self._loop
        assert loop is not None
        last_beat, alive_at = child.beat.value, time.monotonic()
        while not child.closed:
            time.sleep(POLL_S)
            now = time.monotonic()
            beat = child.beat.value
            if beat != last_beat or child.last_message > alive_at:
                last_beat, alive_at = beat, now
                continue
            if now - alive_at < timeout or child.closed or not child.proc.is_alive():
                continue  # (a dead child is the reader's to report)
            child.hung = True
            child.proc.kill()  # SIGKILL ends a stopped process too
            error = EngineHungError(f"the engine process (pid {child.proc.pid}) showed no sign of life for "
                                    f"{now - alive_at:.1f}s (stopped or stuck); it was killed and is being replaced")
            log.error("%s", error)
            loop.call_soon_threadsafe(self._on_death, error)
            return
