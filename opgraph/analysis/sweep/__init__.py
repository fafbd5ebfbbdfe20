"""Sweeps: a step's roofline profile at many configurations, compiled once and vectorised.

    sweep = compile_sweep(step)                           # free dimensions B and S
    cols = sweep.run({"B": batch, "S": seq_len}, peak, bandwidth)   # numpy arrays in and out

`compile_sweep` puts every other dimension's value into each op's cost formula, gives the ops
whose costs are the same expression one term (a matmul's forward and its two backward kernels),
and compiles all the terms with `sympy.lambdify` into one numpy function. `run` calls it on
chunks of points and takes each term's roofline `max(flops / peak, bytes / bandwidth)` and the
sums as array operations.

Invariant: a row is `evaluate` of the same point: the same formulas, summed the same way, in
float64 (agreement to about 1e-15 relative). Layer stacks stay a multiplicity: `L` is a number
put into the formula, or a free dimension of the function, never a loop.

Ranges (`parse_range`): `START:STOP:+STEP` (linear) or `START:STOP:xFACTOR` (geometric, a whole
factor), both including STOP when they land on it; a single value; or a comma list.
"""

from .compiled import CHUNK, Sweep, compile_sweep
from .grid import Grid, make_grid, run_grid, sample
from .ranges import MAX_POINTS, RANGE_HELP, parse_range
from .write import write

__all__ = ["CHUNK", "MAX_POINTS", "RANGE_HELP", "Grid", "Sweep", "compile_sweep", "make_grid",
           "parse_range", "run_grid", "sample", "write"]
