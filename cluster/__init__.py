"""The user-facing entry: connect to or start Ray, the client, the CLI."""

from cluster.client import Ratchet, RunHandle
from cluster.config import ClusterUnavailable
from cluster.report import RunReport, analyse

__all__ = ["ClusterUnavailable", "Ratchet", "RunHandle", "RunReport", "analyse"]
