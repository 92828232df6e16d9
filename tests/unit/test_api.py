"""Single-process checks of the public API's validation."""

import pytest
import torch

import simplefsdp
from toy_models import build


def test_no_process_group_is_a_clear_error() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="process group is not initialised"):
        simplefsdp.data_parallel(build("mlp"))


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
def test_mixed_precision_policy_rejects_non_float(field: str) -> None:
    with pytest.raises(
        ValueError, match=f"{field} must be a floating-point dtype, got torch.int64"
    ):
        simplefsdp.MixedPrecisionPolicy(**{field: torch.int64})
    with pytest.raises(TypeError, match=f"{field} must be a torch.dtype"):
        simplefsdp.MixedPrecisionPolicy(**{field: "bfloat16"})


def test_mixed_precision_policy_is_frozen() -> None:
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with pytest.raises(AttributeError):
        policy.param_dtype = torch.float16


def test_disable_parametrization_nests_and_restores() -> None:
    from simplefsdp.frontend import parametrization_enabled

    assert parametrization_enabled()
    with simplefsdp.disable_parametrization():
        assert not parametrization_enabled()
        with simplefsdp.disable_parametrization():
            assert not parametrization_enabled()
        assert not parametrization_enabled()
    assert parametrization_enabled()
    with pytest.raises(RuntimeError), simplefsdp.disable_parametrization():
        raise RuntimeError("boom")
    assert parametrization_enabled()
