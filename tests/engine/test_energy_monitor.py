import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from engine import device, energy_monitor
from engine.energy_monitor import EnergyLap, EnergyMonitor, first_on_host
from engine.launcher import spawn

MAX_RANGE_UJ = 262_143_328_850  # a real package's max_energy_range_uj


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _package(root: Path, n: int, energy_uj: int, name: str | None = None) -> None:
    d = root / f"intel-rapl:{n}"
    d.mkdir(parents=True)
    (d / "name").write_text(f"{name or f'package-{n}'}\n")
    (d / "max_energy_range_uj").write_text(f"{MAX_RANGE_UJ}\n")
    (d / "energy_uj").write_text(f"{energy_uj}\n")


def _set(root: Path, n: int, energy_uj: int) -> None:
    (root / f"intel-rapl:{n}" / "energy_uj").write_text(f"{energy_uj}\n")


def _rapl_tree(root: Path) -> Path:
    """Two sockets, plus domains that must not be counted: a core sub-domain (the top-level
    link sysfs has for intel-rapl:0:0) and a platform-wide psys domain."""
    _package(root, 0, 5_000_000)
    _package(root, 1, 7_000_000)
    _package(root, 2, 1_000_000, name="psys")
    sub = root / "intel-rapl:0:0"
    sub.mkdir()
    (sub / "name").write_text("core\n")
    (sub / "energy_uj").write_text("0\n")
    return root


def _monitor(root: Path, clock: FakeClock | None = None, **kw) -> EnergyMonitor:
    m = EnergyMonitor("cpu", sysfs_root=root, clock=clock or FakeClock(), **kw)
    m.setup()
    return m


def test_rapl_sums_packages_per_lap(tmp_path):
    root, clock = _rapl_tree(tmp_path), FakeClock()
    m = _monitor(root, clock)
    assert (m.source, m.available, m.contributes) == ("rapl", True, True)
    _set(root, 0, 7_000_000)  # +2 J
    _set(root, 1, 10_000_000)  # +3 J
    _set(root, 2, 99_000_000)  # psys: not counted
    clock.t += 2.0
    assert m.lap() == EnergyLap(energy_j=5.0, seconds=2.0, power_w=2.5, cumulative_j=5.0, contributors=1)
    _set(root, 0, 8_000_000)  # +1 J
    clock.t += 0.5
    assert m.lap() == EnergyLap(energy_j=1.0, seconds=0.5, power_w=2.0, cumulative_j=6.0, contributors=1)


def test_rapl_wraparound(tmp_path):
    _package(tmp_path, 0, MAX_RANGE_UJ - 1_000_000)  # 1 J before the wrap
    clock = FakeClock()
    m = _monitor(tmp_path, clock)
    _set(tmp_path, 0, 500_000)  # wrapped, then 0.5 J more
    clock.t += 1.0
    lap = m.lap()
    assert lap.energy_j == pytest.approx(1.5)
    assert lap.power_w == pytest.approx(1.5)


def _missing_energy(root: Path) -> None:
    (root / "intel-rapl:0" / "energy_uj").unlink()


def _garbage_energy(root: Path) -> None:
    _set(root, 0, 0)
    (root / "intel-rapl:0" / "energy_uj").write_text("not a number\n")


def _energy_is_a_directory(root: Path) -> None:
    _missing_energy(root)
    (root / "intel-rapl:0" / "energy_uj").mkdir()


def _second_package_broken(root: Path) -> None:
    (root / "intel-rapl:1" / "max_energy_range_uj").unlink()


@pytest.mark.parametrize(
    "breakage", [_missing_energy, _garbage_energy, _energy_is_a_directory, _second_package_broken]
)
def test_unreadable_rapl_is_unavailable_not_zero(tmp_path, breakage):
    root = _rapl_tree(tmp_path)
    breakage(root)
    m = _monitor(root)
    assert (m.source, m.available) == ("unavailable", False)
    assert m.lap() is None
    assert m.cumulative_j == 0.0


def test_no_powercap_tree_is_unavailable(tmp_path):
    assert EnergyMonitor("cpu", sysfs_root=tmp_path / "absent").source == "unavailable"
    assert EnergyMonitor("cpu", sysfs_root=tmp_path).source == "unavailable"  # empty: no packages


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_root_only_energy_file_is_unavailable(tmp_path):
    root = _rapl_tree(tmp_path)
    (root / "intel-rapl:0" / "energy_uj").chmod(0o000)  # what a non-root user meets: kernels ship it 0400
    assert EnergyMonitor("cpu", sysfs_root=root).source == "unavailable"


def test_a_failed_read_makes_the_lap_unknown(tmp_path):
    root, clock = _rapl_tree(tmp_path), FakeClock()
    m = _monitor(root, clock)
    (root / "intel-rapl:0" / "energy_uj").write_text("")  # a read fails mid-run
    assert m.lap() is None
    _set(root, 0, 6_000_000)
    assert m.lap() is None  # this lap started from the failed reading: unknown too
    _set(root, 0, 9_000_000)
    clock.t += 1.0
    assert m.lap() == EnergyLap(3.0, 1.0, 3.0, 3.0, 1)  # back to normal; failed laps not in the total


def test_pause_excludes_energy_and_time(tmp_path):
    root, clock = _rapl_tree(tmp_path), FakeClock()
    m = _monitor(root, clock)
    _set(root, 0, 6_000_000)  # +1 J training
    clock.t += 1.0
    m.pause()  # evaluation
    m.pause()  # nested: a checkpoint save inside it
    _set(root, 0, 50_000_000)  # +44 J while paused
    clock.t += 30.0
    m.resume()
    _set(root, 0, 60_000_000)  # still paused (outer pause)
    clock.t += 10.0
    m.resume()
    _set(root, 0, 62_000_000)  # +2 J training
    _set(root, 1, 8_000_000)  # +1 J training
    clock.t += 3.0
    assert m.lap() == EnergyLap(energy_j=4.0, seconds=4.0, power_w=1.0, cumulative_j=4.0, contributors=1)


def test_lap_while_paused_reports_what_came_before_the_pause(tmp_path):
    root, clock = _rapl_tree(tmp_path), FakeClock()
    m = _monitor(root, clock)
    _set(root, 0, 6_000_000)
    clock.t += 1.0
    m.pause()
    _set(root, 0, 9_000_000)
    clock.t += 5.0
    assert m.lap() == EnergyLap(1.0, 1.0, 1.0, 1.0, 1)
    m.resume()
    _set(root, 0, 10_000_000)
    clock.t += 2.0
    assert m.lap() == EnergyLap(1.0, 2.0, 0.5, 2.0, 1)


def test_call_order_errors(tmp_path):
    m = EnergyMonitor("cpu", sysfs_root=_rapl_tree(tmp_path))
    with pytest.raises(RuntimeError, match="call setup"):
        m.lap()
    m.setup()
    with pytest.raises(RuntimeError, match="without a matching pause"):
        m.resume()


def test_first_on_host():
    hosts = [7, 7, 9, 9, 7]
    assert [first_on_host(hosts, r) for r in range(5)] == [True, False, True, False, False]


def test_gpu_job_without_nvml_does_not_fall_back_to_rapl(tmp_path, monkeypatch):
    monkeypatch.setattr(energy_monitor, "load_nvml", lambda: None)
    m = EnergyMonitor("cuda", sysfs_root=_rapl_tree(tmp_path))
    assert (m.source, m.available) == ("unavailable", False)
    m.setup()
    assert m.lap() is None


class FakeNvml:
    """The few pynvml calls the monitor makes (same names), with a settable counter in mJ."""

    def __init__(self) -> None:
        self.mj = 1_000_000
        self.indices: list[int] = []

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.indices.append(index)
        return f"gpu{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return uuid

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:
        return self.mj


def test_nvml_counter_in_millijoules(monkeypatch):
    nvml = FakeNvml()
    monkeypatch.setattr(energy_monitor, "load_nvml", lambda: nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    clock = FakeClock()
    m = EnergyMonitor("cuda", clock=clock)
    assert m.source == "nvml" and nvml.indices == [5]  # CUDA device 1 is NVML device 5
    m.setup()
    nvml.mj += 1_500  # 1.5 J
    clock.t += 0.5
    assert m.lap() == EnergyLap(1.5, 0.5, 3.0, 1.5, 1)
    nvml.mj = 10  # driver reloaded: the counter restarted
    assert m.lap() is None


def _gpu_has_nvml() -> bool:
    return torch.cuda.is_available() and energy_monitor.load_nvml() is not None


@pytest.mark.skipif(not _gpu_has_nvml(), reason="needs an NVIDIA GPU")
def test_nvml_counter_increases_and_matches_nvidia_smi(monkeypatch):
    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs an NVIDIA GPU (nvidia-smi not found)")
    monkeypatch.setattr(device, "_DEVICE", torch.device("cuda", 0))
    nvml = energy_monitor.load_nvml()
    uuid = nvml.nvmlDeviceGetUUID(energy_monitor.nvml_device_handle(nvml, 0))
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    m = EnergyMonitor("cuda")
    assert m.source == "nvml"
    m.setup()
    smi = subprocess.Popen(
        ["nvidia-smi", "-i", uuid, "--query-gpu=power.draw", "--format=csv,noheader,nounits", "-lms", "200"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            for _ in range(10):
                a = (a @ a).clamp_(-1, 1)
            device.synchronize()
    finally:
        smi.terminate()
        out, _ = smi.communicate(timeout=10)
    lap = m.lap()
    readings = [float(x) for x in out.split() if x.replace(".", "", 1).isdigit()]
    assert readings, out
    smi_w = sum(readings[2:] or readings) / len(readings[2:] or readings)  # skip the ramp-up
    assert lap is not None and lap.energy_j > 0 and lap.seconds >= 3.5
    assert 0.6 * smi_w <= lap.power_w <= 1.5 * smi_w, (lap, smi_w, readings)


def _two_ranks_one_host(root: str, broken_root: str) -> tuple:
    import torch.distributed as dist

    rank, tree = dist.get_rank(), Path(root)
    m = EnergyMonitor("cpu", sysfs_root=tree)
    m.setup()
    doubled = EnergyMonitor("cpu", sysfs_root=tree, contributes=True)  # what not to do
    doubled.setup()
    dist.barrier()
    if rank == 0:
        _set(tree, 0, 9_000_000)  # +4 J
        _set(tree, 1, 9_000_000)  # +2 J
    dist.barrier()
    lap, doubled_lap = m.lap(), doubled.lap()

    # Availability is agreed: rank 1 cannot read its counter, so nobody reports a lap.
    partial = EnergyMonitor("cpu", sysfs_root=tree if rank == 0 else Path(broken_root))
    partial.setup()
    return m.source, m.contributes, lap, doubled_lap, partial.source, partial.lap()


def test_two_ranks_on_one_host_count_the_sockets_once(tmp_path):
    root = _rapl_tree(tmp_path / "powercap")
    out = spawn(_two_ranks_one_host, world_size=2, args=(str(root), str(tmp_path / "none")), timeout_s=120)
    (src0, contrib0, lap0, dbl0, part_src0, part0), (src1, contrib1, lap1, dbl1, part_src1, part1) = out
    assert (src0, src1) == ("rapl", "rapl")
    assert (contrib0, contrib1) == (True, False)  # rank 0 is the host's lowest rank
    assert lap0 == lap1
    assert lap0.energy_j == pytest.approx(6.0) and lap0.contributors == 1
    assert lap0.power_w == pytest.approx(lap0.energy_j / lap0.seconds)
    assert dbl0.energy_j == pytest.approx(12.0) and dbl0.contributors == 2  # each socket twice
    assert (part_src0, part_src1) == ("rapl", "unavailable")
    assert part0 is None and part1 is None
