"""The compiler's core: the IR and everything that defines or checks a graph.

`ir` (tensors, ops, the graph), `symbols` (dimension symbols), `kinds` and `rules` (each op
kind's traits), `builder` (the API models are written with), `rewrite` and `fusion` (pattern
rewriting, fusion policies), `contracts` and `pipeline` (what each pass needs, the driver that
orders and checks them), `verify`, `categories` and `choices` (the vocabularies of cost
categories and of the options), `parameters`, `errors`, `limits` and `datafile` (a user's TOML
or config.json, parsed, never evaluated)."""
