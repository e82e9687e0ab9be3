"""One declaration per statistic: typed snapshot dataclasses whose fields carry
their help text and how they are exported.

``stat(help, ...)`` is a ``dataclasses.field`` whose metadata says what the
value means and which Prometheus family it feeds (name, counter or gauge,
fixed labels). The REST response models (``hicache.api.models``) and the
``/metrics`` families (``hicache.api.metrics``) are generated from these
dataclasses, so adding a counter is one new field here.

Metadata keys:
- ``help``: what the value is (REST field description; family help).
- ``metric``: the family name without the ``hicache_`` prefix; ``None`` when
  the field is an identity or a label (``tier``, ``fingerprint``), not a value.
- ``kind``: ``"counter"`` or ``"gauge"``.
- ``labels``: fixed labels of this field's series (``{"op": "hit"}``), so
  several fields can share one family.
- ``family_help``: the family's help when several fields share it.
- ``invert``: a bool exported as ``1 - value`` (``down`` -> ``up``).
- ``key_label``: for ``dict[str, <dataclass>]`` fields, the label naming each key.
- ``gate``: a bool field that, when false, removes its object from ``/metrics``.
- ``scoped``: a nested dataclass whose series do not inherit the parent's labels.
- ``prefix``: a nested dataclass whose families are named ``prefix + name`` (an
  engine's misses, ``engine_miss_pages``, beside the node's ``miss_pages``).
- ``name_label``: a ``key_label`` field's value names its series by this field of
  each value when set (the engine's own name), the key going to label ``id_label``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

Kind = Literal["counter", "gauge"]


def stat(help: str, *, metric: str | None = "", kind: Kind = "counter", labels: dict[str, str] | None = None,
         family_help: str | None = None, invert: bool = False, key_label: str | None = None, gate: bool = False,
         scoped: bool = False, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING,
         prefix: str = "", name_label: tuple[str, str] | None = None) -> Any:
    """A dataclass field declaring one statistic (see the module docstring)."""
    meta = {"help": help, "metric": metric, "kind": kind, "labels": dict(labels or {}), "family_help": family_help,
            "invert": invert, "key_label": key_label, "gate": gate, "scoped": scoped, "prefix": prefix,
            "name_label": name_label}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def help_of(f: dataclasses.Field) -> str:
    return str(f.metadata.get("help", ""))


def metric_of(f: dataclasses.Field) -> str | None:
    """The family name this field feeds (its own name by default), or None."""
    m = f.metadata.get("metric", "")
    return None if m is None else (m or f.name)
