"""The digest of a call's inputs (Note: [Ranks' first inputs])."""

import torch

from simplefsdp.compiler.first_inputs import input_digest


def test_digest_follows_shapes_dtypes_structure_and_values_not_data() -> None:
    x = torch.zeros(2, 16, dtype=torch.long)
    base = input_digest((x,), {"mask": None})
    assert input_digest((torch.ones(2, 16, dtype=torch.long),), {"mask": None}) == base
    assert 0 <= base < 2**63
    different = [
        input_digest((torch.zeros(2, 10, dtype=torch.long),), {"mask": None}),  # shape
        input_digest((x.int(),), {"mask": None}),  # dtype
        input_digest((x,), {}),  # structure
        input_digest((x,), {"mask": x}),  # a tensor where None was
        input_digest((x, 3), {"mask": None}),  # an extra value
    ]
    assert base not in different
    assert input_digest((x, 3), {}) != input_digest((x, 4), {})  # Dynamo specialises on ints
