"""What a compiled step is read as, and measured against.

`diff` (two steps side by side), `solve` (where a condition on the costs holds), `sweep` (the
figures over ranges), `explain` (why the planner chose a layout, and how sure), `validate`
(predictions of published runs against what was measured), `fit` (the calibrated model's
efficiencies fitted to those runs) and `traces` (real profiler traces beside the roofline)."""
