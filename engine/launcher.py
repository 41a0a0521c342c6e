"""Run a function on N local ranks with a real process group: the torchrun of this project.

One launcher serves `elastron train` and every multi-rank test, so the way ranks start, bind
threads and devices, and report failures is the same in both. Ranks are forked from a
forkserver that has torch and the engine imported once (a rank starts in a fraction of a second
instead of re-importing them), each gets a gloo (CPU) or NCCL (CUDA) group on a free loopback port, and
the parent collects each rank's return value or traceback. When one rank fails, the others are
given a short grace period and then terminated, so a crash never turns into a hang on a
collective.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

# A collective that waits longer than this is a hang, not a slow step: fail the rank.
PROCESS_GROUP_TIMEOUT_S = 1800.0


class RankFailure(RuntimeError):
    """One or more ranks raised or died; `failures` maps rank -> traceback or exit description, and
    `exits` rank -> (exit code, message) for an exception that asked for an exit code (the rerun
    state machine's RerunExit; see `agreed_exit`).

    The likely cause comes first: a rank that died without reporting (killed, os._exit), else
    the first rank that raised. The others are usually peers that lost their connection to it.
    """

    def __init__(self, failures: dict[int, str], exits: dict[int, tuple[int, str]] | None = None):
        self.exits = dict(exits or {})
        died = [r for r, msg in failures.items() if msg.startswith(DIED)]
        order = died + [r for r in failures if r not in died]
        self.failures = {r: failures[r] for r in order}
        first = order[0]
        others = f" (then ranks {sorted(set(failures) - {first})})" if len(failures) > 1 else ""
        super().__init__(f"rank {first} failed{others}:\n{failures[first]}")

    def agreed_exit(self) -> tuple[int, str] | None:
        """(exit code, message) when every failed rank asked for the same exit code."""
        codes = {self.exits.get(r, (None, ""))[0] for r in self.failures}
        if len(codes) != 1 or None in codes:
            return None
        return next(self.exits[r] for r in self.failures)


DIED = "process exited with code"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    device_type: str,
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: mp.Queue,
    timeout_s: float,
    env: dict[str, str],
) -> None:
    import torch
    import torch.distributed as dist

    from engine import device

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.update(env)
    torch.set_num_threads(device.cpu_threads_per_rank(world_size))
    try:
        device.set_device(device_type, rank)
        dist.init_process_group(
            device.backend_for(device_type),
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=min(timeout_s, PROCESS_GROUP_TIMEOUT_S)),
        )
        out = fn(*args)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException as err:  # noqa: BLE001 - everything a rank raises goes back to the parent
        # An exception carrying an exit code (the rerun state machine's 16/17) keeps it.
        code = getattr(err, "exit_code", None)
        results.put((rank, False, (traceback.format_exc(), None if code is None else (code, str(err)))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    # The engine's training stack too: each rank importing it costs ~1.2 s of CPU, which a
    # 2-core machine pays per rank per spawn (test_parallel_layouts: 58 s -> 19 s with it here).
    ctx.set_forkserver_preload(["torch", "engine.device", "engine.train_loop"])
    return ctx


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    device_type: str = "cpu",
    timeout_s: float = 300.0,
    grace_s: float = 5.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on ranks 0..world_size-1; return the per-rank results in rank order.

    `fn` must be importable by name (a module-level function). `env` is set in every rank (ranks
    fork from a server started with the environment of the first spawn, so later changes to this
    process's environment do not reach them). Raises RankFailure naming every rank that raised,
    died, or did not finish within `timeout_s`.
    """
    ctx = _context()
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, device_type, fn, tuple(args), results, timeout_s, dict(env or {})),
            name=f"elastron-rank-{rank}",
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    exits: dict[int, tuple[int, str]] = {}
    deadline = time.monotonic() + timeout_s
    first_failure_at: float | None = None
    try:
        while len(outputs) + len(failures) < world_size:
            now = time.monotonic()
            if now > deadline:
                for r in range(world_size):
                    if r not in outputs and r not in failures:
                        failures[r] = f"did not finish within {timeout_s:.0f} s"
                break
            if first_failure_at is not None and now - first_failure_at > grace_s:
                for r in range(world_size):
                    if r not in outputs and r not in failures:
                        failures[r] = "terminated after another rank failed"
                break
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if r not in outputs and r not in failures and p.exitcode is not None:
                        # Exited without reporting: killed by a signal or os._exit. Drain first.
                        time.sleep(0.2)
                        if results.empty():
                            failures[r] = f"{DIED} {p.exitcode} without a result"
                            first_failure_at = first_failure_at or time.monotonic()
                continue
            if ok:
                outputs[rank] = pickle.loads(payload)
            else:
                failures[rank], asked = payload
                if asked is not None:
                    exits[rank] = asked
                first_failure_at = first_failure_at or time.monotonic()
    finally:
        for p in procs:
            if p.is_alive() and (failures or p.exitcode is None):
                p.join(timeout=0.5 if failures else grace_s)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise RankFailure(failures, exits)
    return [outputs[r] for r in range(world_size)]
