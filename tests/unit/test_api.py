"""Single-process checks of the public API's validation."""

import subprocess
import sys

import pytest
import torch

import simplefsdp
from toy_models import build


def test_no_process_group_is_a_clear_error() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="process group is not initialised"):
        simplefsdp.data_parallel(build("mlp"))


def test_sparse_embeddings_are_a_clear_error() -> None:
    # Validated before the process group is looked up.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.EmbeddingBag(9, 4, sparse=True))
    with pytest.raises(ValueError, match=r"submodule '1' \(EmbeddingBag\) has sparse=True"):
        simplefsdp.data_parallel(model)
    model[1].requires_grad_(False)  # frozen: no gradient, nothing to reduce
    with pytest.raises(ValueError, match="process group is not initialised"):
        simplefsdp.data_parallel(model)


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


def test_import_and_cli_do_not_import_torch() -> None:
    code = (
        "import sys, simplefsdp, simplefsdp.cli\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print(simplefsdp.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == simplefsdp.__version__


def test_top_level_exports() -> None:
    from simplefsdp.compiler.entry_points import RecompileLimitError
    from simplefsdp.compiler.report import CommReport
    from simplefsdp.eager_executor import EagerExecutor, eager, get_eager_executor, remove_eager
    from simplefsdp.frontend import DataParallelState
    from simplefsdp.frontend.expert_parallel import ExpertParallel

    for name in simplefsdp.__all__:
        assert getattr(simplefsdp, name) is not None, name
    assert set(dir(simplefsdp)) >= set(simplefsdp.__all__)
    assert set(simplefsdp.__all__) == {*simplefsdp._LAZY, "__version__"}
    assert simplefsdp.ExpertParallel is ExpertParallel
    assert simplefsdp.RecompileLimitError is RecompileLimitError
    assert simplefsdp.CommReport is CommReport
    assert simplefsdp.DataParallelState is DataParallelState
    assert simplefsdp.EagerExecutor is EagerExecutor
    assert simplefsdp.eager is eager
    assert simplefsdp.get_eager_executor is get_eager_executor
    assert simplefsdp.remove_eager is remove_eager
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        simplefsdp.nope  # noqa: B018
