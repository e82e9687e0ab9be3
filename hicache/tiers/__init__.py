"""The scheduler side of tiering, which moves no bytes: the two-phase tier manager
(``manager``) and the plans it prepares (``plans``), what a load holds between its
phases (``holds``), the registry of in-flight jobs (``inflight``), making room on L1
(``room``), the L2 strategies (``l2``), the load-vs-recompute cost model (``cost``)
and the debug state machine of L2 pages.

Imports ``core``, ``memory``, ``index``, ``transfer`` (a plan's route), ``client`` and
``storage``."""
