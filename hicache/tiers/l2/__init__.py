"""L2 as one strategy (``base.L2Tier``): this engine's private pinned pool
(``private.PrivateL2``) or the node service's shared segment (``shared.SharedL2``,
over the connection in ``segment``); ``factory.open_l2`` picks one from the
configuration. This ``__init__`` imports nothing, so importing a submodule
runs no other."""
