"""The interconnect table: the checklist's four planning bandwidths reproduce its transfer times for 640 MB,
every row has its sources, and a measured bandwidth is placed against the fabric links."""

from __future__ import annotations

import pytest

from pdserve.hardware.links import CHECKLIST_LINKS, LINKS, classify, link


def test_checklist_links_reproduce_its_transfer_times_for_640_mb():
    ms = {name: round(link(name).transfer_s(640e6) * 1e3, 1) for name in CHECKLIST_LINKS}
    assert ms == {"NVLink 4": 1.7, "InfiniBand NDR": 12.8, "RoCE 100G": 53.3, "Ethernet 25G (TCP)": 213.4}


def test_every_link_has_its_sources_and_positive_figures():
    assert len({c.name for c in LINKS}) == len(LINKS) == 13
    for c in LINKS:
        assert c.line_rate_source and c.achievable_source and c.latency_source
        assert 0 < c.achievable_GB_s <= c.line_rate_GB_s and c.latency_s > 0


def test_measured_bandwidth_is_placed_against_the_fabric_links():
    here = classify(4.15)  # ucxx shared memory on this machine, 256 MiB
    assert (here.nearest.name, here.fastest_reached.name, here.rdma_class) == (
        "Ethernet 25G (TCP)",
        "Ethernet 25G (TCP)",
        False,
    )
    ib = classify(49.0)
    assert (ib.nearest.name, ib.fastest_reached.name, ib.rdma_class) == ("InfiniBand NDR", "RoCE 400G", True)
    assert classify(1.0).fastest_reached is None
    with pytest.raises(ValueError):
        classify(0.0)
    with pytest.raises(KeyError, match="known"):
        link("token ring")
