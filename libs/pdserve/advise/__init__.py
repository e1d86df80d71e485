"""`pdserve advise`: the disaggregation checklist and the four deployment stages turned into a decision.

`models` (what a model moves and holds: KV and recurrent-state bytes per request, weight bytes),
`economics` (exercise A: transfer against recompute per link; exercise E: weight duplication against fleet
size), `evidence` (the measurements read from a stack's event log, each with where it was measured),
`decide` (the stage, 1-4, and the reasoning step by step), `plot`.
"""
