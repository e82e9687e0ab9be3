"""The node service's core data structures: the shared L2 segment's index
(``l2_index``) and its L3 writer / read-through (``l3_tier``). ``hicache.api``
keeps only the interfaces over them (socket handlers, REST routes)."""
