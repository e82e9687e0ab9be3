"""L2 as one strategy (``base.L2Tier``): this engine's private pinned pool
(``private.PrivateL2``) or the node service's shared segment (``shared.SharedL2``,
over the connection ``shared.ServiceHostTier``). ``base.open_l2`` opens the memory
the configuration names and ``base.build_l2`` builds the strategy over the index,
complete. This ``__init__`` imports nothing, so importing a submodule runs no other."""
