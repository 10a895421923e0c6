"""A training step as a dataflow graph: ``dataflow`` (the graph), ``importer`` (a traced step to a
graph), ``simulate`` (peak memory of an order), ``schedule`` (peak-memory ordering: ILP and window
search), ``partition`` (what to keep and what to recompute: a min-cut)."""
