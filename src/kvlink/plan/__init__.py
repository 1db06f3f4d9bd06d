"""Pure transfer planning: which bytes of P go to which bytes of D."""

from kvlink.plan.compat import IncompatibleLayout, check_compatible, check_configuration
from kvlink.plan.descriptors import count_merged, desc_ids_attention, desc_ids_hybrid
from kvlink.plan.plan_types import SourcePlan
from kvlink.plan.request import ReadSpec
from kvlink.plan.tp_mapping import TPMapping, UnitRun, compute_tp_mapping, consumers_per_producer
from kvlink.plan.transfer_plan import TransferPlan, build_transfer_plan

__all__ = [
    "IncompatibleLayout",
    "ReadSpec",
    "SourcePlan",
    "TPMapping",
    "TransferPlan",
    "UnitRun",
    "build_transfer_plan",
    "check_compatible",
    "check_configuration",
    "compute_tp_mapping",
    "consumers_per_producer",
    "count_merged",
    "desc_ids_attention",
    "desc_ids_hybrid",
]
