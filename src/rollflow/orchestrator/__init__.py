"""Wiring and lifecycle of a run: the Orchestrator, its schedules, the weight barrier and checkpoints."""

from rollflow.orchestrator.orchestrator import Orchestrator

__all__ = ["Orchestrator"]
