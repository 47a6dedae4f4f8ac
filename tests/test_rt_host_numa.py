"""Where a GPU's pinned host tier is placed: the CPUs of the NUMA node the GPU hangs off, read from sysfs,
and the calling thread moved onto them while the pages are allocated."""

from __future__ import annotations

import os

import pytest

from strata_runtime.experts import host
from strata_runtime.experts.host import cpu_list, node_cpus, on_cpus


def _sysfs(tmp_path, nodes: dict[int, str], gpu_node: int | str, bus: str = "0000:1b:00.0"):
    for n, cpus in nodes.items():
        d = tmp_path / "devices/system/node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    dev = tmp_path / "bus/pci/devices" / bus
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text(f"{gpu_node}\n")
    return tmp_path


def test_a_cpulist_reads_ranges_and_single_cpus():
    assert cpu_list("0-3,8,10-11\n") == frozenset({0, 1, 2, 3, 8, 10, 11})
    assert cpu_list("5") == frozenset({5})
    assert cpu_list("") == frozenset()


def test_the_gpus_node_gives_its_cpus_by_the_bus_id_in_either_case(tmp_path):
    root = _sysfs(tmp_path, {0: "0-7,16-23", 1: "8-15,24-31"}, 1)
    assert node_cpus("0000:1B:00.0", root) == cpu_list("8-15,24-31")
    assert node_cpus("0000:1b:00.0", root) == cpu_list("8-15,24-31")


@pytest.mark.parametrize(
    ("nodes", "gpu_node", "bus"),
    [
        ({0: "0-15"}, 0, "0000:1b:00.0"),  # one node: nothing to choose
        ({0: "0-7", 1: "8-15"}, -1, "0000:1b:00.0"),  # the firmware does not say
        ({0: "0-7", 1: "8-15"}, "x", "0000:1b:00.0"),  # unreadable
        ({0: "0-7", 1: "8-15"}, 1, "0000:2c:00.0"),  # another device than the one asked about
    ],
)
def test_no_cpus_where_the_node_is_not_known_or_there_is_one(tmp_path, nodes, gpu_node, bus):
    root = _sysfs(tmp_path, nodes, gpu_node, bus)
    assert node_cpus("0000:1b:00.0", root) == frozenset()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this system")
def test_the_block_runs_on_the_nodes_cpus_and_the_thread_goes_back_after():
    before = os.sched_getaffinity(0)
    one = frozenset({min(before)})
    with on_cpus(one | {10_000}):  # a CPU the process may not use is left out
        inside = os.sched_getaffinity(0)
    assert inside == one
    assert os.sched_getaffinity(0) == before
    with on_cpus(frozenset({10_000})):  # none allowed: where it was
        assert os.sched_getaffinity(0) == before
    with pytest.raises(RuntimeError), on_cpus(one):
        raise RuntimeError("restored on the way out")
    assert os.sched_getaffinity(0) == before


class _Device:
    def __init__(self, index: int) -> None:
        self.index = index

    @property
    def pci_bus_id(self) -> str:
        if self.index > 0:
            raise AttributeError("pci_bus_id")  # a CuPy that cannot say
        return "0000:1B:00.0"


def test_a_gpus_cpus_come_from_its_bus_id_and_none_where_cupy_cannot_give_it(monkeypatch):
    cuda = type("cuda", (), {"Device": _Device})
    monkeypatch.setattr(host, "cupy_module", lambda: type("cupy", (), {"cuda": cuda}))
    asked = []
    monkeypatch.setattr(host, "node_cpus", lambda bus: asked.append(bus) or frozenset({8, 9}))
    host.gpu_cpus.cache_clear()
    try:
        assert host.gpu_cpus(0) == frozenset({8, 9})
        assert host.gpu_cpus(1) == frozenset()
        assert asked == ["0000:1B:00.0"]
    finally:
        host.gpu_cpus.cache_clear()
