"""Files in and out: case files, launch configs and the outputs written.

`cases` (published runs as data, read and checked), `launch` (torchtitan and Megatron-LM
configs, read and written) and `outputs` (reports, tables, Chrome traces, plots, progress,
atomic writes)."""
