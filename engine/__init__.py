"""Weir's batching engine: usable on its own as ``from engine import AsyncEngine``."""

from engine.cost import CostWeights, request_cost, worst_case_cost
from engine.types import EngineStats, RequestOutput, SamplingParams

__all__ = [
    "AsyncEngine",
    "CostWeights",
    "EngineConfig",
    "EngineStats",
    "RequestOutput",
    "SamplingParams",
    "request_cost",
    "worst_case_cost",
]


def __getattr__(name: str):  # lazy: importing the value types must not load torch
    if name in ("AsyncEngine", "EngineConfig"):
        from engine import client

        return getattr(client, name)
    raise AttributeError(name)
