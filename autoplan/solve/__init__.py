"""Solve: the fastest (or cheapest) parallel plan of a model on a cluster, proven by CP-SAT.

`search(graph, cluster, request)` returns ranked candidates; `to_plan` turns one into the
serialisable Plan that estimate --plan, generate, report and the runtime consume.
"""

from autoplan.solve.plan_build import to_plan
from autoplan.solve.search import Candidate, SearchResult, search
from autoplan.solve.space import Request, parse_fix

__all__ = ["Candidate", "Request", "SearchResult", "parse_fix", "search", "to_plan"]
