"""A training step as a dataflow graph: ``dataflow`` (the graph), ``importer`` (a traced step to a
graph, with PyTorch's own release points), ``simulate`` (peak memory of an order), ``allocator``
(the peak the CPU allocator measures for the same eager step), ``problem`` (the ordering problem
reduced to allocating nodes, and its lower bound), ``ilp`` (the ordering ILP for HiGHS),
``schedule`` (peak-memory ordering: heuristics, ILP and window search), ``partition`` (what to
keep and what to recompute: a min-cut)."""
