"""A step over many GPUs: layouts, clusters, collectives, the schedule and the planner.

`parallel` (the layout record), `cluster` and `collectives` (the network and what a collective
costs on it), `frameworks` (what each framework does differently), `distributed` (compile a
layout's stages and schedule them), `schedule` (one GPU's streams and waits) and `search`
(every layout of a job, bounded and ranked)."""
