"""The engine side of the node service: the frame format (``protocol``), the socket
connection (``link``) and hit consensus across TP/CP ranks (``consensus``).

An engine process imports this package, never ``hicache.node`` (the server).
Imports ``core`` and ``memory``."""
