"""`elastron up` / `elastron down`: a local Ray head and the API, in the background.

Everything lives under ELASTRON_HOME (default ~/.elastron):
  elastron.db       the SQLite store            token        the local admin token (0600)
  api.pid, api.log  the API (uvicorn)           api_url      where the API listens
  ray.pid, ray.log  the Ray head (ray start)    ray_address  its dashboard / Jobs API
  ray_token         the local Ray head's auth token (0600)
  checkpoints/      default checkpoint root of jobs that set no checkpoint.path

The Ray head runs as `ray start --head --block` under our own pid, so `down` stops exactly the
processes `up` started (never `ray stop`, which would stop every Ray cluster on the machine).
`down` sends it SIGTERM, which Ray's node handles itself (its processes stopped gracefully, as
atexit would), not SIGINT: a head started from a background shell inherits SIGINT ignored, and
then sat out `down`'s whole wait before being killed (60 s in every CI run).
All of Ray's ports are picked free, so this head coexists with other local clusters. The head
gets RAY_JOB_STOP_SIGNAL=SIGINT (a cancelled job's driver gets the signal Ray Train handles
gracefully) and this Python's bin directory first on PATH (so the entrypoint `elastron
worker-run` resolves inside Ray jobs).

Ray 2.60 heads use token auth (RAY_AUTH_MODE=token), and `ray start` refuses to start one without
a token. Unless the user brings one (RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH), the local head gets
its own in ELASTRON_HOME/ray_token, handed to the head (so to its jobs) and to the API through
RAY_AUTH_TOKEN_PATH: nothing is written to ~/.ray, whose token would switch every later `ray
start` on this machine to token auth.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from service.settings import Settings

Echo = Callable[[str], None]
# How long `down` waits for each process to exit on its SIGTERM before killing it: the API's
# shutdown stops its reconciler; the Ray head's stops every Ray process it started.
API_STOP_S = 30.0
RAY_HEAD_STOP_S = 60.0


class StackError(RuntimeError):
    pass


@dataclass(frozen=True)
class StackInfo:
    api_url: str
    ray_address: str
    token_file: Path
    home: Path
    started: bool  # False: it was already up


def free_port(preferred: int | None = None) -> int:
    if preferred is not None and _port_free(preferred):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _alive(pid_file: Path, marker: str) -> int | None:
    """The pid in `pid_file` if that process still runs and is ours (its command line has `marker`)."""
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError):
        return None
    return pid if marker in cmdline else None


def _spawn(cmd: list[str], log_file: Path, env: dict[str, str]) -> subprocess.Popen:
    log = open(log_file, "ab")  # noqa: SIM115 - handed to the child, which outlives us
    try:
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    finally:
        log.close()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def ray_auth_env(home: Path) -> dict[str, str]:
    """The auth settings for the local Ray head and its clients (see the module docstring)."""
    env = {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return env
    path = home / "ray_token"
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return {**env, "RAY_AUTH_TOKEN_PATH": str(path)}


def start_ray_head(
    home: Path, dashboard_port: int | None = None, num_cpus: int | None = None
) -> tuple[subprocess.Popen, str]:
    """Start `ray start --head --block` with free ports; returns the process and the dashboard URL."""
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        raise StackError(f"no `ray` next to {sys.executable}: install elastron's dependencies (ray[default])")
    dashboard = free_port(dashboard_port)
    ports = {
        "--port": free_port(),
        "--dashboard-port": dashboard,
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(),
        "--metrics-export-port": free_port(),
        "--ray-client-server-port": free_port(),
        "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
    }
    cmd = [
        str(ray_bin),
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        "--node-ip-address",
        "127.0.0.1",
        "--dashboard-host",
        "127.0.0.1",
        "--include-dashboard",
        "true",
    ]
    if num_cpus is not None:
        cmd += ["--num-cpus", str(num_cpus)]
    for flag, port in ports.items():
        cmd += [flag, str(port)]
    env = dict(os.environ)  # with the auth settings `up` exported (ray_auth_env)
    env.update(
        RAY_JOB_STOP_SIGNAL="SIGINT",
        # Ray Jobs' default 3 s before SIGKILL is shorter than Ray Train's graceful abort and a
        # checkpoint's commit: give a cancelled job time to finish cleanly.
        RAY_JOB_STOP_WAIT_TIME_S=env.get("RAY_JOB_STOP_WAIT_TIME_S", "60"),
        RAY_USAGE_STATS_ENABLED="0",
        # On SIGTERM (`down`) Ray first drains the node for Ray Serve, 30 s by default; nothing
        # here serves traffic.
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=env.get("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0"),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    home.mkdir(parents=True, exist_ok=True)
    proc = _spawn(cmd, home / "ray.log", env)
    return proc, f"http://127.0.0.1:{dashboard}"


def wait_for_ray(
    proc: subprocess.Popen | None, address: str, log_file: Path | None, timeout_s: float = 120.0
) -> None:
    from service.launcher import RayJobsLauncher

    launcher = RayJobsLauncher(address, timeout_s=5.0)
    deadline = time.monotonic() + timeout_s
    while not launcher.reachable():
        if proc is not None and proc.poll() is not None:
            raise StackError(
                f"the Ray head exited ({proc.returncode}):\n{_tail(log_file) if log_file else ''}"
            )
        if time.monotonic() > deadline:
            raise StackError(f"Ray at {address} did not answer within {timeout_s:.0f} s")
        time.sleep(0.5)


def stop_process(pid: int, sig: int, timeout_s: float) -> bool:
    """Signal `pid`, wait for it to exit, then kill its whole session (it leads one:
    start_new_session). True when it exited on the signal, False when it had to be killed."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return False


def _ensure_token(settings: Settings, echo: Echo) -> None:
    if settings.token_file.exists():
        return
    from service.store.db import make_engine, make_sessionmaker
    from service.store.migrate import upgrade
    from service.store.tokens import create_token

    engine = make_engine(settings.resolved_database_url)
    upgrade(engine)
    _, secret = create_token(make_sessionmaker(engine), "local", admin=True)
    engine.dispose()
    settings.token_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(settings.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    echo(f"created an admin token for tenant 'local' in {settings.token_file}")


def up(
    settings: Settings,
    *,
    port: int | None = None,
    ray_address: str | None = None,
    ray_dashboard_port: int | None = None,
    echo: Echo = print,
) -> StackInfo:
    home = settings.home
    home.mkdir(parents=True, exist_ok=True)
    api_pid = _alive(home / "api.pid", "service.app:create_app")
    if api_pid is not None:
        return StackInfo(
            (home / "api_url").read_text().strip(),
            (home / "ray_address").read_text().strip(),
            settings.token_file,
            home,
            started=False,
        )
    _ensure_token(settings, echo)

    if ray_address is None:
        # Our own head: this process (its readiness check) and the API use its token.
        os.environ.update(ray_auth_env(home))
        ray_pid = _alive(home / "ray.pid", "ray")
        if ray_pid is not None and (home / "ray_address").exists():
            ray_address = (home / "ray_address").read_text().strip()
            echo(f"Ray head already running (pid {ray_pid}) at {ray_address}")
        else:
            echo("starting a local Ray head (RAY_JOB_STOP_SIGNAL=SIGINT) ...")
            proc, ray_address = start_ray_head(home, ray_dashboard_port)
            (home / "ray.pid").write_text(f"{proc.pid}\n")
            (home / "ray_address").write_text(ray_address + "\n")
            wait_for_ray(proc, ray_address, home / "ray.log")
    else:
        (home / "ray_address").write_text(ray_address + "\n")

    api_port = free_port(port or 8000)
    api_url = f"http://127.0.0.1:{api_port}"
    env = dict(os.environ)
    env.update(
        ELASTRON_HOME=str(home),
        ELASTRON_RAY_ADDRESS=ray_address,
        ELASTRON_API_URL=api_url,
        RAY_AUTH_MODE=env.get("RAY_AUTH_MODE", "token"),  # for a --ray-address cluster too
    )
    env.setdefault("ELASTRON_CHECKPOINT_DIR", str(home / "checkpoints"))
    # On one machine the Ray dashboard is the user's own: the web UI may link to it.
    env.setdefault("ELASTRON_RAY_DASHBOARD_URL", ray_address)
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "service.app:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(api_port),
        "--log-level",
        "info",
    ]
    echo(f"starting the API on {api_url} ...")
    proc = _spawn(cmd, home / "api.log", env)
    (home / "api.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{api_url}/healthz", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise StackError(f"the API exited ({proc.returncode}):\n{_tail(home / 'api.log')}")
        if time.monotonic() > deadline:
            raise StackError(f"the API did not answer on {api_url} within 60 s; see {home / 'api.log'}")
        time.sleep(0.2)
    (home / "api_url").write_text(api_url + "\n")
    return StackInfo(api_url, ray_address, settings.token_file, home, started=True)


def down(settings: Settings, echo: Echo = print) -> bool:
    """Stop what `up` started; True if anything was running."""
    home, stopped = settings.home, False
    api_pid = _alive(home / "api.pid", "service.app:create_app")
    if api_pid is not None:
        echo(f"stopping the API (pid {api_pid}); running jobs keep running on Ray while Ray is up")
        if not stop_process(api_pid, signal.SIGTERM, API_STOP_S):
            echo(f"the API did not stop within {API_STOP_S:.0f} s of SIGTERM: killed it")
        stopped = True
    ray_pid = _alive(home / "ray.pid", "ray")
    if ray_pid is not None:
        echo(f"stopping the Ray head (pid {ray_pid}) and its jobs")
        # Ray's own SIGTERM handler stops its processes (SIGTERM to each, then a kill).
        if not stop_process(ray_pid, signal.SIGTERM, RAY_HEAD_STOP_S):
            echo(f"the Ray head did not stop within {RAY_HEAD_STOP_S:.0f} s of SIGTERM: killed its processes")
        stopped = True
    for name in ("api.pid", "ray.pid", "api_url"):
        (home / name).unlink(missing_ok=True)
    return stopped
