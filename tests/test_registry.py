"""The rule registry across torch versions: an op the running torch lacks is skipped, listed and logged."""

import logging

import pytest
import torch

from shardtensor.ops import registry


def test_the_skipped_ops_are_the_ones_this_torch_lacks():
    """torch 2.14 removed `aten.cholesky` (deprecated since 1.9); 2.13 has every op we have a rule for."""
    expected = [] if hasattr(torch.ops.aten, "cholesky") else ["aten.cholesky.default"]
    assert registry.skipped_ops() == expected
    assert all(isinstance(op, torch._ops.OpOverload) for op in registry.RULES)


def test_a_missing_op_is_skipped_at_registration_with_a_debug_line(caplog):
    missing = registry.aten.no_such_op_in_any_torch.default
    assert missing == registry.MissingOp("no_such_op_in_any_torch", "default")
    assert registry.aten.add is torch.ops.aten.add  # present ops are torch's own
    rules_before = dict(registry.RULES)
    try:
        with caplog.at_level(logging.DEBUG, logger="shardtensor.ops.registry"):
            registry.register_rule([missing, registry.aten.no_such_op_in_any_torch], registry.same_layout)
        assert "aten.no_such_op_in_any_torch.default" in registry.skipped_ops()
        assert "aten.no_such_op_in_any_torch" in registry.skipped_ops()
        assert [record.getMessage() for record in caplog.records] == [
            f"skipped the rule of aten.no_such_op_in_any_torch.default: torch {torch.__version__} has no such op",
            f"skipped the rule of aten.no_such_op_in_any_torch: torch {torch.__version__} has no such op",
        ]
        assert registry.RULES == rules_before
    finally:
        registry._SKIPPED.difference_update({"aten.no_such_op_in_any_torch.default", "aten.no_such_op_in_any_torch"})
    with pytest.raises(AttributeError, match=r"aten.no_such_op_in_any_torch.default is not in torch .* '_schema'"):
        missing._schema
