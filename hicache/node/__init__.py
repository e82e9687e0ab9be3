"""The node service (``hicache serve``): the shared L2 segment's index, its L3 writer
and read-through, the socket server and its operations, KV events and snapshots.

Engine processes never import this package; they use ``hicache.client``."""
