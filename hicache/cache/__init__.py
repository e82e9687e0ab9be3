"""The engine-facing caches: ``HiCache`` (the embedded three-tier cache), the hybrid
model cache over layer groups, prefill->decode handoff and owned metadata slots.

The top of the library: imports every plane below it, and nothing imports it
except integrations, the reference engine, the node service's replay and the CLI."""
