"""What an op, a step and its memory cost: the cost models and the data they read.

`costmodel` (an op's FLOPs, bytes and time; the roofline and the calibrated model),
`hardware` and `calibration` (parts and their measured efficiencies, read from
opgraph/hardware.toml and opgraph/calibration.toml), `gemms` (measured GEMM tables), `formula`
(costs as sympy formulas), `memory` (the step's HBM footprint) and `profile` (what `evaluate`
returns: per-op rows, per-category totals, the step's figures)."""
