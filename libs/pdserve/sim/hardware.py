"""Which hardware profile a pool runs on: one the profile file holds by name ('measured', or an entry of
`Profile.hardware`), or one scaled on the fly from the profile's efficiency, named as `scaled_profile`
names them: `<accelerator>-tp<N>-<model>-<dtype>` (e.g. h100-sxm-tp8-llama-3-70b-bf16)."""

from __future__ import annotations

import re

from pdserve.hardware.accelerators import accelerator
from pdserve.sim.model_shape import published_shape
from pdserve.sim.profile import HardwareProfile, Profile
from pdserve.sim.roofline import scaled_profile

_NAME = re.compile(r"^(?P<acc>.+?)-tp(?P<tp>\d+)-(?P<model>.+)-(?P<dtype>fp32|tf32|bf16|fp16|fp8)$")


def resolve_hardware(profile: Profile, name: str | None) -> HardwareProfile:
    """The hardware profile called `name` (None: 'measured'). Raises KeyError naming what exists."""
    try:
        return profile.hardware_profile(name)
    except KeyError:
        match = _NAME.match(name or "")
        if match is None:
            raise
    return scaled_profile(
        accelerator(match["acc"]),
        published_shape(match["model"]),
        profile.efficiency,
        dtype=match["dtype"],
        tensor_parallel=int(match["tp"]),
    )
