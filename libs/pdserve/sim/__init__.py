"""A discrete-event simulator of pdserve deployments (docs/architecture.md §17): `pdserve profile` measures
this engine into a `Profile` (`profile.py`, `measure.py`), `roofline.py` scales it to published
accelerators, `cluster.py` simulates colocated or disaggregated pools in virtual time, `search.py` finds
the goodput and the cheapest pool split."""
