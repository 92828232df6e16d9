"""simplefsdp's torch.compile backend, graph passes and reports."""

from simplefsdp.compiler.backend import CompileOptions, SimpleFSDPBackend
from simplefsdp.compiler.cost_model import CostModel, LinearFit
from simplefsdp.compiler.entry_points import comm_report, compile, compile_backend
from simplefsdp.compiler.report import CommReport
