"""The replicas' Lighthouse (torchft's quorum server) with a liveness relay: a replica process
that dies is out of the next quorum within `RELAY_TIMEOUT_MS`, not after the job's
`resilience.replica_heartbeat_timeout_ms`.

torchft 0.2.0's Lighthouse learns of a death only when a replica's heartbeats stop for its
`heartbeat_timeout_ms`, and with two replicas its split-brain rule (a quorum needs more than half
of the replicas still heartbeating) keeps the survivor waiting for exactly that. A long timeout
keeps a live replica on a loaded host or a slow network in the quorum; a short one notices a
death sooner. The relay separates the two cases:

- every replica process holds one TCP connection to the relay (`LivenessLink`). When the process
  dies (SIGKILL, the OOM killer, a crash) its kernel closes the connection, and the relay stops
  heartbeating for it at once;
- the relay heartbeats every replica with an open connection, from the Lighthouse's own host,
  every `RELAY_INTERVAL_MS`. So the Lighthouse can run with a short timeout (`RELAY_TIMEOUT_MS`)
  without a network hiccup ever dropping a live replica;
- a replica whose host vanished without closing the connection (a lost node, a cut network)
  sends no more pings on it. The relay drops it after the job's own
  `replica_heartbeat_timeout_ms`, as before.

The replicas' torchft ManagerServers still heartbeat the Lighthouse themselves; the relay only
adds heartbeats.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import urlparse

# The Lighthouse's own heartbeat timeout, fed by the relay from its host. It is the floor of
# the survivors' stall after a replica process dies. The margin is for the relay's Python
# thread: five heartbeats per timeout. Each costs the head node ~0.2 ms of CPU (RPC and the
# Lighthouse's own work): 10 ms intervals cost 4.5 % of a core for two replicas (bench/recovery.py
# survive's `cpu_cores`, with and without the relay).
RELAY_TIMEOUT_MS = 100
RELAY_INTERVAL_MS = 20
QUORUM_TICK_MS = 10



class Lighthouse:
    """torchft's LighthouseServer plus the liveness relay, in one process (a Ray actor on the
    head node, or a test's own process).

    `silent_timeout_ms`: a replica whose connection stays open but sends no ping for this long
    (its node is gone) is no longer heartbeated. This is the job's `replica_heartbeat_timeout_ms`.
    `join_timeout_ms`: how long a quorum waits for a replica that heartbeats but has not asked
    to join.
    `relay`: False runs torchft's Lighthouse alone, its heartbeat timeout `silent_timeout_ms`
    (what torchft users get; bench/recovery.py's `--compare-no-relay`)."""

    def __init__(
        self,
        silent_timeout_ms: int = 500,
        join_timeout_ms: int | None = None,
        bind: str = "[::]:0",
        relay: bool = True,
    ):
        from torchft.coordination import LighthouseServer

        self.silent_timeout_s = silent_timeout_ms / 1000
        self.server = LighthouseServer(
            bind=bind,
            min_replicas=1,
            join_timeout_ms=join_timeout_ms if join_timeout_ms is not None else silent_timeout_ms,
            quorum_tick_ms=QUORUM_TICK_MS,
            heartbeat_timeout_ms=RELAY_TIMEOUT_MS if relay else silent_timeout_ms,
        )
        self._closed = threading.Event()
        self._pings: dict[str, float] = {}  # replica id -> when its link last pinged
        self._lock = threading.Lock()
        self._liveness_address = ""  # no relay: the replicas link to nothing
        self._listener = None
        if relay:
            self._start_relay()

    def _start_relay(self) -> None:
        from torchft.coordination import LighthouseClient

        self._client = LighthouseClient(self.server.address(), connect_timeout=timedelta(seconds=10))
        dual = socket.has_dualstack_ipv6()  # as torchft's "[::]" bind: v4 and v6 peers alike
        self._listener = socket.create_server(
            ("", 0), family=socket.AF_INET6 if dual else socket.AF_INET, dualstack_ipv6=dual
        )
        self._listener.settimeout(0.5)
        host = urlparse(self.server.address()).hostname or socket.gethostname()
        self._liveness_address = f"{host}:{self._listener.getsockname()[1]}"
        for target in (self._accept, self._relay):
            threading.Thread(target=target, daemon=True, name=f"lighthouse-{target.__name__}").start()

    def address(self) -> str:
        """torchft's address (what TORCHFT_LIGHTHOUSE holds)."""
        return self.server.address()

    def liveness_address(self) -> str:
        """host:port of the relay (what workers.replicas.LIVENESS_ENV carries to the ranks); empty
        without the relay."""
        return self._liveness_address

    def linked(self) -> list[str]:
        """The replica ids the relay heartbeats now (for tests and the actor's status)."""
        now = time.monotonic()
        with self._lock:
            return [rid for rid, at in self._pings.items() if now - at < self.silent_timeout_s]

    def shutdown(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        self.server.shutdown()

    # ------------------------------------------------------------------ threads
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True, name="lighthouse-link").start()

    def _read(self, conn: socket.socket) -> None:
        """One replica's link: its id on the first line, then a byte per ping. EOF or a reset:
        the process is gone."""
        rid = None
        buf = b""
        with conn:
            try:
                while not self._closed.is_set():
                    data = conn.recv(4096)
                    if not data:
                        break
                    if rid is None:
                        buf += data
                        if b"\n" not in buf:
                            continue
                        line, _ = buf.split(b"\n", 1)
                        rid = line.decode()
                    with self._lock:
                        self._pings[rid] = time.monotonic()
            except OSError:
                pass
            finally:
                if rid is not None:
                    with self._lock:
                        self._pings.pop(rid, None)

    def _relay(self) -> None:
        interval = RELAY_INTERVAL_MS / 1000
        while not self._closed.wait(interval):
            for rid in self.linked():
                try:
                    self._client.heartbeat(rid)
                except Exception:  # the Lighthouse is shutting down: nothing to keep alive
                    if self._closed.is_set():
                        return


class LivenessLink:
    """A replica process's end of the relay: the connection whose close tells the Lighthouse
    this process is gone, and a ping every `interval_s` that says its host is still there.

    The same connection tells the replica when the Lighthouse's process is gone (the relay never
    writes, so a readable socket is its close): `on_lost` runs once, on the link's thread.
    Without it a replica learns of it only when its quorum times out."""

    def __init__(
        self, address: str, replica_id: str, interval_s: float, on_lost: Callable[[], None] | None = None
    ):
        host, port = address.rsplit(":", 1)
        self._sock = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
        self._sock.sendall(replica_id.encode() + b"\n")
        self._closed = threading.Event()
        self._interval_s = interval_s
        self._on_lost = on_lost
        threading.Thread(target=self._ping, daemon=True, name="liveness-link").start()

    def _ping(self) -> None:
        while not self._closed.wait(self._interval_s):
            try:
                self._sock.sendall(b".")
                readable, _, _ = select.select([self._sock], [], [], 0)
                if not readable or self._sock.recv(64):
                    continue
            except OSError:
                pass
            # EOF, a reset or a broken pipe: the Lighthouse's end is closed
            if not self._closed.is_set() and self._on_lost is not None:
                self._on_lost()
            return

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.close()
        except OSError:
            pass
