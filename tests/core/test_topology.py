import os

import pytest

from writescope.topology import emulated_topology, parse_cpulist, read_topology, topology


def test_cpulist_parsing():
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("") == ()


def test_host_topology_covers_the_allowed_cpus():
    nodes = read_topology()
    assert sorted(c for n in nodes for c in n.cpus) == sorted(os.sched_getaffinity(0))


def test_fake_sysfs_is_read(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    for index, cpus in enumerate([allowed[:1], allowed[1:]]):
        (tmp_path / f"node{index}").mkdir()
        (tmp_path / f"node{index}" / "cpulist").write_text(",".join(map(str, cpus)))
    nodes = read_topology(str(tmp_path))
    assert [n.cpus for n in nodes if n.cpus] == [tuple(c) for c in (allowed[:1], allowed[1:]) if c]


def test_emulation_splits_the_cpus_evenly():
    cpus = sorted(os.sched_getaffinity(0))
    nodes = emulated_topology(len(cpus))
    assert [n.cpus for n in nodes] == [(c,) for c in cpus] and all(n.emulated for n in nodes)
    with pytest.raises(ValueError, match="cannot emulate"):
        emulated_topology(len(cpus) + 1)


def test_environment_variable_emulates(monkeypatch):
    monkeypatch.setenv("WRITESCOPE_NUMA_NODES", "1")
    assert len(topology()) == 1 and topology()[0].emulated
    monkeypatch.setenv("WRITESCOPE_NUMA_NODES", "two")
    with pytest.raises(ValueError, match="WRITESCOPE_NUMA_NODES must be a positive integer"):
        topology()
