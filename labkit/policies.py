"""Moved to :mod:`labkit.hub.policies`; this name stays only until ``labkit/experiments`` imports
``POLICIES`` from there (``labkit.experiments.slowclient``)."""
from labkit.hub.policies import POLICIES

__all__ = ["POLICIES"]
