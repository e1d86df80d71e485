"""Published hardware numbers the simulator scales to: accelerators (`accelerators.py`) and links
(`links.py`). Every number carries the datasheet it comes from."""
