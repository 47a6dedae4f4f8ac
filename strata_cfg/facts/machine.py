"""Machine facts: the GPUs from the profile's ``[machine]`` table, or probed with ``nvidia-smi``, and the host
memory the engine may pin, from ``machine.host_ram_mib`` or, when probing, from /proc/meminfo.

The probe never goes through CuPy, so that `strata plan` stays light. A probed card's bandwidth comes from
a table of known cards; an unknown card gets an estimate, flagged as such in the plan.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

from ..profile.load import LoadedProfile
from ..schema.bounded_read import read_bounded
from ..schema.facts import GpuFacts, MachineFacts

KNOWN_BANDWIDTH_GBS: dict[str, float] = {
    "H200": 4800,
    "H100 NVL": 3900,
    "H100 80GB HBM3": 3350,
    "H100 SXM": 3350,
    "H100 PCIe": 2000,
    "H100": 2000,
    "GH200": 4000,
    "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935,
    "A100-SXM4-40GB": 1555,
    "A100-PCIE-40GB": 1555,
    "A100": 1555,
    "L40S": 864,
    "L40": 864,
    "L4": 300,
    "A40": 696,
    "A10G": 600,
    "A10": 600,
    "T4": 320,
    "V100": 900,
    "RTX PRO 6000": 1792,
    "RTX 6000 Ada": 960,
    "RTX A6000": 768,
    "RTX A5000": 768,
    "RTX A4000": 448,
    "RTX 5090": 1792,
    "RTX 5080": 960,
    "RTX 5070 Ti": 896,
    "RTX 5060 Ti": 448,
    "RTX 4090": 1008,
    "RTX 4080 SUPER": 736,
    "RTX 4080": 717,
    "RTX 4070 Ti SUPER": 672,
    "RTX 4060 Ti": 288,
    "RTX 3090 Ti": 1008,
    "RTX 3090": 936,
    "RTX 3080 Ti": 912,
    "RTX 3080": 760,
    "RTX 3060": 360,
    "R9700": 640,
}
ESTIMATED_BANDWIDTH_GBS = 500.0
"""Bandwidth assumed for a card the table does not know (flagged as an estimate in the plan)."""

_SMI_QUERY = ("--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits")


def known_bandwidth(name: str) -> float | None:
    """The bandwidth of a card by (a part of) its name, or None for a card the table does not know."""
    matches = [k for k in KNOWN_BANDWIDTH_GBS if k.lower() in name.lower()]
    return KNOWN_BANDWIDTH_GBS[max(matches, key=len)] if matches else None


def parse_nvidia_smi(text: str) -> list[GpuFacts]:
    """Parse ``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits`` output."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        index, rest = line.split(",", 1)
        name, mem = (part.strip() for part in rest.rsplit(",", 1))
        bandwidth = known_bandwidth(name)
        gpus.append(
            GpuFacts(
                index=int(index.strip()),
                name=name,
                vram_mib=int(float(mem)),
                bandwidth_gbs=bandwidth or ESTIMATED_BANDWIDTH_GBS,
                bandwidth_estimated=bandwidth is None,
            )
        )
    return gpus


def probe_nvidia_smi() -> str:
    """Run nvidia-smi and return its CSV; raises OSError when there is no usable nvidia-smi."""
    import shutil  # only when probing: keeps `strata plan` on a written [machine] from paying for it
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise OSError("nvidia-smi was not found on PATH")
    try:
        done = subprocess.run([exe, *_SMI_QUERY], capture_output=True, text=True, timeout=20, check=False)
    except subprocess.TimeoutExpired:
        raise OSError("nvidia-smi did not answer within 20 s") from None
    if done.returncode != 0:
        raise OSError(f"nvidia-smi failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


MEMINFO = "/proc/meminfo"
_MEMINFO_LINE = re.compile(r"^(MemAvailable|MemTotal):\s+(\d+)\s*kB\s*$", re.M)


def read_meminfo() -> str:
    """The text of /proc/meminfo; raises OSError where there is none."""
    return read_bounded(MEMINFO, 1 << 20).decode("ascii", errors="replace")


def parse_meminfo(text: str) -> int | None:
    """The host memory the engine may pin, in MiB: ``MemAvailable`` (what can be taken without pushing
    other programs out), else ``MemTotal`` on kernels too old to report it; None if neither is there."""
    found = {name: int(kb) for name, kb in _MEMINFO_LINE.findall(text)}
    kb = found.get("MemAvailable", found.get("MemTotal"))
    return kb // 1024 if kb else None


def _probed_ram(meminfo: Callable[[], str]) -> int | None:
    """The probed host memory in MiB, or None (unknown) when it cannot be read: unknown is not an error."""
    try:
        return parse_meminfo(meminfo())
    except (OSError, ValueError):
        return None


def machine_facts(
    loaded: LoadedProfile,
    *,
    probe: Callable[[], str] = probe_nvidia_smi,
    meminfo: Callable[[], str] = read_meminfo,
) -> MachineFacts:
    """The machine's GPUs from ``[machine]``, or from ``probe`` when it says ``probe = true``; the host memory
    from ``machine.host_ram_mib``, else from ``meminfo`` when probing, else unknown."""
    m = loaded.profile.machine
    if m is None or (m.gpus is None and not m.probe):
        raise loaded.problem(
            "machine",
            "no GPUs given: write [machine] gpus = [{ name, vram_mib, bandwidth_gbs }, ...] or probe = true",
        )
    backend = m.backend or "cuda"
    if m.gpus is not None:
        gpus = tuple(
            GpuFacts(index=i, name=g.name, vram_mib=g.vram_mib, bandwidth_gbs=g.bandwidth_gbs)
            for i, g in enumerate(m.gpus)
        )
        source: Literal["profile", "probe"] | None = "profile" if m.host_ram_mib else None
        return MachineFacts(
            backend=backend, gpus=gpus, source="profile", host_ram_mib=m.host_ram_mib, host_ram_source=source
        )
    if backend == "cpu":
        raise loaded.problem("machine.probe", "virtual CPU devices cannot be probed: write [machine] gpus")
    try:
        found = parse_nvidia_smi(probe())
    except (OSError, ValueError, IndexError) as exc:
        raise loaded.problem(
            "machine.probe", f"cannot probe the GPUs ({exc}); write [machine] gpus instead"
        ) from None
    if not found:
        raise loaded.problem("machine.probe", "the probe found no GPUs; write [machine] gpus instead")
    ram, source = (m.host_ram_mib, "profile") if m.host_ram_mib else (_probed_ram(meminfo), "probe")
    return MachineFacts(
        backend="cuda",
        gpus=tuple(found),
        source="probe",
        host_ram_mib=ram,
        host_ram_source=source if ram else None,
    )
