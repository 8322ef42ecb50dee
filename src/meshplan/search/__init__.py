"""Plan search: the declared space, vectorised constraints, bounds, evaluation, ranking.

    from meshplan.search import search, SearchSpace
    result = search(model, cluster, work, SearchSpace())

One entry point for any cluster (one GPU type, several sizes of one, or several GPU pools) and
any workload (one length or a distribution): the driver runs the bucket stage and the pools
stage itself, and returns one SearchResult (on pools with its pooled fields).
"""
from meshplan.search.driver import search
from meshplan.search.result import RankedPlan, SearchResult
from meshplan.search.space import SearchSpace, enumerate_space

__all__ = ["RankedPlan", "SearchResult", "SearchSpace", "enumerate_space", "search"]
