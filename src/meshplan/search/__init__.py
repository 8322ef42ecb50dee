"""Plan search: the declared space, vectorised constraints, bounds, evaluation, ranking.

    from meshplan.search import search, SearchSpace
    result = search(model, cluster, work, SearchSpace())
"""
from meshplan.search.driver import search
from meshplan.search.result import RankedPlan, SearchResult
from meshplan.search.space import SearchSpace, enumerate_space

__all__ = ["RankedPlan", "SearchResult", "SearchSpace", "enumerate_space", "search"]
