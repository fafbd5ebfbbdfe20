"""Every op kind has a row in every per-kind table, so a missing rule fails here, not in a run."""

import pytest
from opgraph.models import PRESETS, preset
from opgraph.passes.derive_backward import VJP_RULES

from opgraph import Phase, compile_step
from opgraph.core import rules
from opgraph.cost.costmodel import BACKWARD_COST
from opgraph.core.parameters import ACTIVE_FRACTION

TABLES = {"SHAPE_RULES": rules.SHAPE_RULES, "FLOP_RULES": rules.FLOP_RULES,
          "VJP_RULES": VJP_RULES, "BACKWARD_COST": BACKWARD_COST}


def test_every_forward_kind_has_a_row():
    """Every kind a forward graph may hold has a backward rule; collectives (the sharding
    passes') too, and they are costed by their message, not the plate's convention."""
    assert set(VJP_RULES) == {*rules.FORWARD_KINDS, *rules.COLLECTIVE_KINDS}
    assert set(BACKWARD_COST) == set(rules.FORWARD_KINDS)


def test_every_kind_has_a_shape_and_a_flop_rule():
    """Forward kinds, their backward kernels, the optimizer's and a fused group's (`fused`, made
    by `Replacement.fuse`), the precision and parallel passes' kernels and the collectives: the
    two tables agree."""
    kinds = {*rules.FORWARD_KINDS, *rules.BACKWARD_KINDS, "adamw", "fused",
             *rules.PRECISION_KINDS, *rules.PARALLEL_KINDS, *rules.COLLECTIVE_KINDS}
    assert set(rules.SHAPE_RULES) == set(rules.FLOP_RULES) == kinds


def test_the_mixture_of_experts_kinds_are_in_every_table():
    for kind in ("topk", "expert_matmul", "moe_combine"):
        assert all(kind in t for t in TABLES.values()), kind


def test_rows_are_named_functions():
    for name, table in TABLES.items():
        for kind, rule in table.items():
            assert rule.__name__ != "<lambda>", f"{name}[{kind!r}] is a lambda"


def test_routed_kinds_are_forward_kinds():
    assert set(ACTIVE_FRACTION) <= set(rules.FORWARD_KINDS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_kind_a_preset_uses_has_its_rules(name):
    forward = preset(name)
    kinds = {op.kind for op in forward.ops()}
    for table in TABLES.values():
        assert kinds <= set(table), (name, kinds - set(table))
    for fused in (True, False):
        step = compile_step(forward, fused_attention=fused)
        assert {op.phase for op in step.ops()} == {Phase.FORWARD, Phase.BACKWARD,
                                                   Phase.OPTIMIZER}
        used = {op.kind for op in step.ops()}  # backward and optimizer kinds included
        for table in ("SHAPE_RULES", "FLOP_RULES"):
            assert used <= set(TABLES[table]), (name, fused, table, used - set(TABLES[table]))
