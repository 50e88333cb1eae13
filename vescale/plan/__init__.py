"""Plan API (VescalePlan, phases), its IR and lowering against a model and a mesh."""

from .api import INIT, RUN, Phase, Statement, VescalePlan
from .ir import Entry, PlanError, PlanIR
from .lower import lower

__all__ = ["INIT", "RUN", "Phase", "Statement", "VescalePlan", "Entry", "PlanError", "PlanIR", "lower"]
