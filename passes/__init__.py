"""The passes, one module each, named by its verb: `opgraph.passes.derive_backward`,
`fuse_attention`, `attach_adamw`, `evaluate`, and the optional `fuse_elementwise` (whose policy
table is `opgraph.core.fusion`). Each module holds its pass and its rule tables; the pass functions
themselves are exported by `opgraph` (`from opgraph import derive_backward`), so that
`opgraph.passes.derive_backward` stays the module, tables and all.
"""
