"""Partition: the joint forward+backward graph, what the backward keeps, and the split.

``joint`` describes the adjoint as named values with sizes, ``policy`` chooses the capture set
(the min-cut itself is TVM-free and lives in ``analysis.memory.partition``), ``split`` builds the
forward and backward functions from that choice.
"""
