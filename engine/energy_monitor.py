"""Energy consumed by the job between two log points, summed over ranks, in joules.

Sources, chosen once per rank from the job's device type:
- "nvml": on CUDA, the GPU's total-energy counter (`nvmlDeviceGetTotalEnergyConsumption`, mJ since
  the driver loaded) for this rank's device. Every rank owns one GPU, so every rank contributes.
- "rapl": on CPU, the Linux powercap package domains (`intel-rapl:N/energy_uj`, wrapping at
  `max_energy_range_uj`; AMD's driver uses the same names). A package counter covers the whole
  socket, shared by every rank on the host, so exactly one rank per host contributes; the others
  add 0 and the sum over ranks counts each socket once.
- "unavailable": anything else (no NVML, RAPL not readable: since 2020 most kernels make
  `energy_uj` root-only). A GPU job without NVML does not fall back to RAPL: CPU package energy is
  not the GPUs' energy. Unavailable is reported as None, never as zero or an estimate.

Which rank contributes on a host: the lowest rank of `group` that shares this kernel's boot id
(the hostname where there is none), agreed with one all-gather in `setup()`. Containers on one
machine share the boot id, and its sockets, while their hostnames differ; LOCAL_RANK is not used
because not every launcher sets it. `contributes=` overrides the choice.

Energy consumed while paused (evaluation, checkpointing) is left out, as in Megatron-Core, and so
is the paused wall time, so power = energy / seconds is the training power. RAPL counters wrap
every few minutes under load (about 20 min at 200 W for a 262 kJ range): laps, pauses and resumes
must come more often than that, which a log interval does; a lap that spans more than one wrap
under-counts.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from engine import device
from engine.distributed.collectives import all_gather_into

DEFAULT_POWERCAP_ROOT = Path("/sys/class/powercap")
_PACKAGE_DIR = re.compile(r"^intel-rapl:\d+$")  # intel-rapl:N:M are sub-domains, inside a package


def load_nvml() -> Any | None:
    """The initialised `pynvml` module, or None. Any failure (package missing, no driver, a broken
    install) means "no NVML": the caller reports energy as unavailable instead of crashing."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - a broken NVML is an unavailable one
        return None


def nvml_device_handle(nvml: Any, cuda_index: int) -> Any:
    """The NVML handle of CUDA device `cuda_index` of this process.

    NVML numbers every GPU on the machine; CUDA numbers only those in CUDA_VISIBLE_DEVICES (which
    Ray sets), so the index is translated through that list (integers or GPU UUIDs). An integer
    entry is taken as an nvidia-smi index, which is CUDA's order unless the machine mixes GPU
    models and CUDA_DEVICE_ORDER is left at FASTEST_FIRST.
    """
    visible = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    if not visible:
        return nvml.nvmlDeviceGetHandleByIndex(cuda_index)
    entry = visible[cuda_index]
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    return nvml.nvmlDeviceGetHandleByUUID(entry)


def cuda_index() -> int:
    """This rank's CUDA device index, from engine.device (LOCAL_RANK before set_device ran)."""
    d = device.current_device()
    if d.type == "cuda" and d.index is not None:
        return d.index
    return int(os.environ.get("LOCAL_RANK", "0"))


class _Counter(Protocol):
    def read(self) -> tuple[int, ...]: ...

    def delta_uj(self, before: tuple[int, ...], after: tuple[int, ...]) -> int | None: ...


class NvmlCounter:
    """One GPU's energy counter; a reading is (µJ,) so every source sums in one unit."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml, self._handle = nvml, handle

    def read(self) -> tuple[int, ...]:
        return (int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)) * 1000,)

    def delta_uj(self, before: tuple[int, ...], after: tuple[int, ...]) -> int | None:
        # The 64-bit mJ counter never wraps; going back means the driver reloaded: unknown.
        return after[0] - before[0] if after[0] >= before[0] else None


class RaplCounter:
    """The package domains under a powercap root; a reading is one `energy_uj` per package."""

    def __init__(self, energy_files: list[Path], max_ranges_uj: list[int]) -> None:
        self._files, self._ranges = energy_files, max_ranges_uj

    @classmethod
    def open(cls, root: str | Path) -> RaplCounter | None:
        """The counter over every package domain, or None when any of them cannot be read (a sum
        over only the readable sockets would under-report)."""
        try:
            dirs = sorted(p for p in Path(root).iterdir() if _PACKAGE_DIR.match(p.name))
        except OSError:
            return None
        files, ranges = [], []
        for d in dirs:
            try:
                # "psys" (whole platform, on some laptops) overlaps the packages: skip it.
                if not (d / "name").read_text().strip().startswith("package"):
                    continue
                ranges.append(int((d / "max_energy_range_uj").read_text()))
                int((d / "energy_uj").read_text())
            except (OSError, ValueError):
                return None
            files.append(d / "energy_uj")
        return cls(files, ranges) if files and all(r > 0 for r in ranges) else None

    def read(self) -> tuple[int, ...]:
        return tuple(int(f.read_text()) for f in self._files)

    def delta_uj(self, before: tuple[int, ...], after: tuple[int, ...]) -> int | None:
        total = 0
        for b, a, span in zip(before, after, self._ranges, strict=True):
            total += a - b if a >= b else a + span - b  # wrapped once past max_energy_range_uj
        return total


def host_id() -> int:
    """A positive int64 naming the machine: its kernel's boot id, else its hostname."""
    try:
        key = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        key = socket.gethostname()
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:7], "big")


def first_on_host(host_ids: list[int], rank: int) -> bool:
    """Whether `rank` is the lowest rank among those with its host id."""
    return host_ids.index(host_ids[rank]) == rank


@dataclass(frozen=True)
class EnergyLap:
    """One lap, identical on every rank. `contributors`: GPUs (nvml) or hosts (rapl) summed, to
    turn the total into per-device figures."""

    energy_j: float
    seconds: float
    power_w: float
    cumulative_j: float
    contributors: int


class EnergyMonitor:
    """Lap energy summed over `group` (default: the world). See the module docstring."""

    def __init__(
        self,
        device_type: str,
        sysfs_root: str | Path = DEFAULT_POWERCAP_ROOT,
        group: Any = None,
        *,
        contributes: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.device_type = device_type
        self._group = group
        self._contributes_arg = contributes
        self._clock = clock
        self._counter: _Counter | None = None
        self.source = "unavailable"
        if device_type == "cuda":
            nvml = load_nvml()
            if nvml is not None:
                try:
                    counter = NvmlCounter(nvml, nvml_device_handle(nvml, cuda_index()))
                    counter.read()  # NotSupported before Volta, and for MIG instances
                    self._counter, self.source = counter, "nvml"
                except Exception:  # noqa: BLE001 - any NVML error means no reading
                    pass
        else:
            rapl = RaplCounter.open(sysfs_root)
            if rapl is not None:
                self._counter, self.source = rapl, "rapl"
        self.contributes = contributes if contributes is not None else True
        self.cumulative_j = 0.0
        self._set_up = False

    @property
    def available(self) -> bool:
        return self._counter is not None

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def setup(self) -> None:
        """Start counting from now. A collective when torch.distributed is initialised and
        `contributes` was not given (one all-gather of host ids decides who counts a socket)."""
        # Whether every rank has a counter: when one has none, every lap is None, known now, so
        # laps skip their all-reduce (None: not agreed here, each lap finds out).
        self._everyone_has_counter: bool | None = self._counter is not None
        if self._contributes_arg is not None:
            self.contributes = self._contributes_arg
            if self._distributed():
                self._everyone_has_counter = None
        elif self._distributed():
            world = dist.get_world_size(self._group)
            mine = torch.tensor(
                [host_id(), int(self._counter is not None)], dtype=torch.int64, device=device.current_device()
            )
            gathered = torch.empty(2 * world, dtype=torch.int64, device=mine.device)
            all_gather_into(gathered, mine, group=self._group)
            ids, has_counter = gathered.view(world, 2).cpu().t().tolist()
            first = first_on_host(ids, dist.get_rank(self._group))
            self.contributes = self.source == "nvml" or first
            self._everyone_has_counter = all(has_counter)
        else:
            self.contributes = True
        self._pause_depth = 0
        self._pending_uj = 0
        self._missing = False
        self._seconds = 0.0
        self._last = self._read()
        self._started = self._clock()
        self._set_up = True

    def _reads(self) -> bool:
        return self._counter is not None and self.contributes

    def _read(self) -> tuple[int, ...] | None:
        if not self._reads():
            return None
        try:
            return self._counter.read()
        except Exception:  # noqa: BLE001 - a failed read makes this lap unknown, not zero
            self._missing = True
            return None

    def _close_interval(self) -> None:
        """Add the energy and time since the last reading (or resume) to this lap."""
        self._seconds += self._clock() - self._started
        if not self._reads():
            return
        now = self._read()
        if now is None or self._last is None:
            self._missing = True
        else:
            delta = self._counter.delta_uj(self._last, now)
            if delta is None:
                self._missing = True
            else:
                self._pending_uj += delta
        self._last = now

    def _require_setup(self) -> None:
        if not self._set_up:
            raise RuntimeError("EnergyMonitor: call setup() before pause(), resume() or lap()")

    def pause(self) -> None:
        """Stop counting (evaluation, checkpointing). Pauses nest: counting restarts at the
        resume() that matches the first pause()."""
        self._require_setup()
        if self._pause_depth == 0:
            self._close_interval()
        self._pause_depth += 1

    def resume(self) -> None:
        self._require_setup()
        if self._pause_depth == 0:
            raise RuntimeError("EnergyMonitor.resume() without a matching pause()")
        self._pause_depth -= 1
        if self._pause_depth == 0:
            self._last = self._read()
            self._started = self._clock()

    def lap(self) -> EnergyLap | None:
        """Energy since the previous lap (or setup), summed over the group's ranks.

        A collective when torch.distributed is initialised and every rank has a counter (agreed
        in setup(); otherwise every lap is None and costs no communication): every rank calls
        it the same number of times. One int64 SUM all-reduce carries
        [µJ, ranks missing a reading, contributors, lap ns]: a rank misses a reading when its
        source is unavailable or a read of its counter failed in this lap. If any rank missed
        one, the lap is None on every rank (a partial sum would be a silent under-count) and is
        left out of `cumulative_j`. `seconds` is the lap's unpaused wall time, averaged over ranks.
        """
        self._require_setup()
        if self._pause_depth == 0:
            self._close_interval()
            self._started = self._clock()
        if self._everyone_has_counter is False:  # agreed at setup: no lap can be complete
            self._pending_uj, self._missing, self._seconds = 0, False, 0.0
            return None
        missing = self._counter is None or (self._reads() and self._missing)
        local = [
            self._pending_uj if self._reads() else 0,
            int(missing),
            int(self._reads()),
            int(self._seconds * 1e9),
        ]
        self._pending_uj, self._missing, self._seconds = 0, False, 0.0
        totals = torch.tensor(local, dtype=torch.int64, device=device.current_device())
        ranks = 1
        if self._distributed():
            dist.all_reduce(totals, group=self._group)
            ranks = dist.get_world_size(self._group)
        energy_uj, n_missing, contributors, ns = totals.cpu().tolist()
        if n_missing:
            return None
        energy_j = energy_uj / 1e6
        seconds = ns / 1e9 / ranks
        self.cumulative_j += energy_j
        power_w = energy_j / seconds if seconds > 0 else 0.0
        return EnergyLap(energy_j, seconds, power_w, self.cumulative_j, contributors)
