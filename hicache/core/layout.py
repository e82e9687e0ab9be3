"""``KVLayout``: everything that decides the bytes of a page, and its fingerprint.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Literal

from hicache.core.errors import ContractMismatch, LayoutError
from hicache.core.groups import LayerGroup, validate_groups

# Bump when the meaning of a page's bytes changes in a way no field captures.
CONTRACT_VERSION = 1

if TYPE_CHECKING:
    import torch

# Payload dtypes and how they are stored: (torch storage dtype name, bytes).
# fp8 travels as raw bytes: kernels never convert a payload, so uint8 storage
# is exact. Names, not torch dtypes, so that describing a layout (``hicache
# info``, config validation, ``--help``) never imports torch.
_DTYPES: dict[str, tuple[str, int]] = {
    "bfloat16": ("bfloat16", 2),
    "float16": ("float16", 2),
    "float32": ("float32", 4),
    "float8_e4m3fn": ("uint8", 1),
    "float8_e5m2": ("uint8", 1),
    "uint8": ("uint8", 1),
}

# The dtypes a model's KV can be configured with (what errors list). uint8
# stays valid for engines whose host pools are raw bytes (SGLang's fp8 pools).
MODEL_DTYPES = tuple(d for d in _DTYPES if d != "uint8")


def _torch_dtype(name: str) -> "torch.dtype":
    import torch  # deferred: see _DTYPES
    return getattr(torch, name)

# Alignment of every L2 (host) region in bytes: 16 keeps 128-bit loads aligned.
HOST_ALIGN = 16

# Upper bounds of every size field. A layout comes from a config file or from
# another process's handshake; these bound the work (planes built, bytes
# computed) that one layout can cause. Each is far above any real model
# (the largest public models have ~130 layers, 128 KV heads, head dims <= 1024).
LIMITS: dict[str, int] = {
    "num_layers": 1024,
    "draft_layers": 64,
    "num_kv_heads": 1024,
    "head_dim": 8192,
    "kv_lora_rank": 16384,
    "rope_dim": 8192,
    "page_size": 4096,
    "tp_size": 4096,
    "cp_size": 4096,
    "tp_rank": 4095,
    "cp_rank": 4095,
    # kind="rows": one opaque engine row per page. 1 GiB is far above any engine
    # row today (a vLLM chunk of an 8B model at block 16 is 2 MiB) and under
    # MAX_PAGE_BYTES.
    "row_bytes": 1 << 30,
}
# kind="rows": the engine's description of its rows (canonical JSON). vLLM's
# lists its layer names: ~3 KB for 61 layers; 64 KiB bounds a handshake.
MAX_ENGINE_LAYOUT_CHARS = 1 << 16
MAX_EXTRA_PLANES = 16
MAX_PLANE_BYTES_PER_TOKEN = 1 << 20
MAX_MODEL_ID_CHARS = 256
# One page of every plane together; a bigger page could not be allocated anyway.
MAX_PAGE_BYTES = 1 << 31

Kind = Literal["mha", "mla", "rows"]
HostLayout = Literal["layer_first", "page_first"]

# Fields that do not change the bytes of any page: CP decides which rank holds
# a page, never what the page contains, and the host memory layout is not part
# of the canonical (plane-ordered) page encoding. A cp_size 2 prefill can
# therefore hand pages to a cp_size 1 decode. Processes that share one L2
# segment must also agree on host_layout; ``check_shared_l2`` compares it.
_NOT_IN_FINGERPRINT = frozenset({"cp_rank", "cp_size", "host_layout"})
# Fields of kind="rows" only. Left out of the fingerprint and of to_dict() while
# unset, so that the fingerprints of MHA/MLA layouts (written into every L3
# object) and the handshakes with processes that predate the fields are unchanged.
_ROWS_ONLY = ("row_bytes", "engine_layout")
# Engine block interiors ``adopt_paged_kv`` decodes: vLLM's CPU_ATTN keeps, per
# (block, head), the block's K then its V, each a [page_size, head_dim] run.
ENGINE_CELLS = ("", "cpu_attn")


def canonical_json(obj: object) -> str:
    """The one JSON spelling of ``obj`` (sorted keys, no spaces): what ``engine_layout`` holds."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


@dataclass(frozen=True, slots=True)
class BytePlane:
    """An extra per-layer plane of raw bytes (e.g. fp8 indexer key + scale)."""

    name: str
    bytes_per_token: int


@dataclass(frozen=True, slots=True)
class PlaneSpec:
    """One (plane, layer) component of a page. Derived from a ``KVLayout``."""

    index: int  # position in KVLayout.planes
    name: str  # "k", "v", "latent", a byte-plane name, or "draft_" + one of those
    layer: int  # layer index within the target model or within the draft model
    draft: bool
    row_shape: tuple[int, ...]  # shape of one token's row
    dtype_name: str  # torch name of the storage dtype (uint8 for fp8 and byte planes)
    row_bytes: int
    page_bytes: int  # page_size * row_bytes

    @property
    def dtype(self) -> "torch.dtype":
        """The storage dtype (imports torch on first use)."""
        return _torch_dtype(self.dtype_name)


@dataclass(frozen=True)
class KVLayout:
    """Frozen description of one process's KV bytes. Validated on construction.

    ``num_kv_heads`` is the number of KV heads held by this TP rank.

    A page's payload is a list of *planes*, one entry per (plane name, layer):

    * MHA: ``k`` and ``v`` per layer, rows of ``[num_kv_heads, head_dim]``;
    * MLA: ``latent`` per layer, rows of ``[kv_lora_rank + rope_dim]``;
    * extra byte planes (e.g. an fp8 indexer key with its scale) per layer, rows
      of ``[bytes_per_token]`` uint8;
    * draft planes: the same per-layer planes for ``draft_layers`` draft-model
      (EAGLE / NextN) layers, named ``draft_k`` etc.; they share the target's page
      ids, so a page is complete only when both are present;
    * rows (``kind="rows"``): an engine that owns its KV format (vLLM's offload
      tiers) hands over opaque rows. A page is one row of ``row_bytes`` bytes, one
      ``uint8`` plane named ``row``; the engine's own canonical description of
      those bytes (``engine_layout``, a JSON object) enters the fingerprint.

    The canonical plane order (``KVLayout.planes``) is the order of bytes in an L3
    object and the order kernels walk.
    """

    model_id: str
    num_layers: int
    kind: Kind = "mha"
    num_kv_heads: int = 0  # MHA only
    head_dim: int = 0  # MHA only
    kv_lora_rank: int = 0  # MLA only: latent dim
    rope_dim: int = 0  # MLA only: decoupled rope key dim
    dtype: str = "bfloat16"
    page_size: int = 16
    extra_planes: tuple[BytePlane, ...] = ()
    draft_layers: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    row_bytes: int = 0  # rows only: bytes of one page (one engine row)
    engine_layout: str = ""  # rows only: the engine's description of a row, canonical JSON of an object
    host_layout: HostLayout = "layer_first"
    # Hybrid models: layer groups (``hicache.core.groups``); () for a model whose every
    # layer is full attention. In the fingerprint only when non-empty.
    groups: tuple[LayerGroup, ...] = ()
    # The engine's block interior where it is not (head, token) cells of K then V
    # (``ENGINE_CELLS``): the page bytes are canonical either way, but two attention
    # backends compute different KV, so they never share. In the fingerprint only when set.
    engine_cells: str = ""
    _planes: tuple[PlaneSpec, ...] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Counted before anything is built from them: a hello may carry 800K.
        n = len(self.extra_planes) if isinstance(self.extra_planes, (list, tuple)) else -1
        if not 0 <= n <= MAX_EXTRA_PLANES:
            why = f"got {n}" if n >= 0 else f"got a {type(self.extra_planes).__name__}, not a list"
            raise LayoutError(f"KVLayout.extra_planes: at most {MAX_EXTRA_PLANES} extra planes, {why}",
                              "extra_planes", f"<{n} planes>", f"at most {MAX_EXTRA_PLANES}")
        object.__setattr__(self, "extra_planes", tuple(
            p if isinstance(p, BytePlane) else BytePlane(*p) for p in self.extra_planes))
        object.__setattr__(self, "groups", tuple(LayerGroup.of(g) for g in self.groups))
        self._validate()
        validate_groups(self.groups, self.num_layers)
        object.__setattr__(self, "_planes", self._build_planes())

    # ---------------------------------------------------------------- validation
    def _bad(self, name: str, why: str) -> LayoutError:
        value = getattr(self, name)
        shown = repr(value)
        shown = shown if len(shown) <= 80 else f"{shown[:80]}... ({len(shown)} characters)"
        return LayoutError(f"KVLayout.{name}={shown}: {why}", name, value, why)

    def _validate(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id or len(self.model_id) > MAX_MODEL_ID_CHARS:
            raise self._bad("model_id", f"must be a non-empty string of at most {MAX_MODEL_ID_CHARS} "
                            "characters naming the model")
        if self.engine_cells not in ENGINE_CELLS:
            raise self._bad("engine_cells", f"must be one of {ENGINE_CELLS}")
        if self.engine_cells and (self.kind != "mha" or self.extra_planes or self.draft_layers):
            raise self._bad("engine_cells", "only MHA layouts without extra or draft planes have an engine cell order")
        for name in ("num_layers", "page_size", "tp_size", "cp_size", "draft_layers", "tp_rank", "cp_rank",
                     "num_kv_heads", "head_dim", "kv_lora_rank", "rope_dim", "row_bytes"):
            v = getattr(self, name)
            low = 1 if name in ("num_layers", "page_size", "tp_size", "cp_size") else 0
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= LIMITS[name]:
                raise self._bad(name, f"must be an integer in [{low}, {LIMITS[name]}]")
        if self.tp_rank >= self.tp_size:
            raise self._bad("tp_rank", f"must be < tp_size={self.tp_size}")
        if self.cp_rank >= self.cp_size:
            raise self._bad("cp_rank", f"must be < cp_size={self.cp_size}")
        if self.kind not in ("mha", "mla", "rows"):
            raise self._bad("kind", "must be 'mha', 'mla' or 'rows'")
        self._validate_rows()
        if self.kind == "mha":
            for name in ("num_kv_heads", "head_dim"):
                if getattr(self, name) < 1:
                    raise self._bad(name, f"kind='mha' needs {name} >= 1")
            if self.kv_lora_rank or self.rope_dim:
                raise self._bad("kv_lora_rank", "is MLA-only; set kind='mla' or leave it 0")
        elif self.kind == "mla":
            if self.kv_lora_rank < 1:
                raise self._bad("kv_lora_rank", "MLA needs kv_lora_rank >= 1")
            if self.num_kv_heads or self.head_dim:
                raise self._bad("num_kv_heads", "is MHA-only; MLA uses kv_lora_rank/rope_dim")
        if self.dtype not in _DTYPES:
            raise self._bad("dtype", f"must be one of {', '.join(sorted(MODEL_DTYPES))}")
        if self.host_layout not in ("layer_first", "page_first"):
            raise self._bad("host_layout", "must be 'layer_first' or 'page_first'")
        names = {"k", "v", "latent"}
        if len(self.extra_planes) > MAX_EXTRA_PLANES:
            raise self._bad("extra_planes", f"at most {MAX_EXTRA_PLANES} extra planes, got "
                            f"{len(self.extra_planes)}")
        for p in self.extra_planes:
            if (not isinstance(p.name, str) or not p.name.isidentifier() or len(p.name) > 64
                    or p.name in names or p.name.startswith("draft_")):
                raise self._bad("extra_planes", f"plane name {p.name!r} must be a unique identifier, "
                                "not k/v/latent and not starting with 'draft_'")
            b = p.bytes_per_token
            if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= MAX_PLANE_BYTES_PER_TOKEN:
                raise self._bad("extra_planes", f"plane {p.name!r} needs bytes_per_token in "
                                f"[1, {MAX_PLANE_BYTES_PER_TOKEN}], got {b!r}")
            names.add(p.name)
        # Computed before any plane is built: bounded arithmetic on bounded fields.
        size = _DTYPES[self.dtype][1]
        row = (size * 2 * self.num_kv_heads * self.head_dim if self.kind == "mha"
               else self.row_bytes if self.kind == "rows" else size * (self.kv_lora_rank + self.rope_dim))
        row += sum(p.bytes_per_token for p in self.extra_planes)
        page = row * self.page_size * (self.num_layers + self.draft_layers)
        if page > MAX_PAGE_BYTES:
            raise self._bad("num_layers", f"the layout's page would hold {page} bytes, above the limit of "
                            f"{MAX_PAGE_BYTES}; check num_layers, heads, head_dim and page_size")

    def _validate_rows(self) -> None:
        """kind="rows": one uint8 row per page and the engine's description; other kinds: neither."""
        el = self.engine_layout
        if not isinstance(el, str) or len(el) > MAX_ENGINE_LAYOUT_CHARS:
            raise self._bad("engine_layout", f"must be a string of at most {MAX_ENGINE_LAYOUT_CHARS} characters")
        if self.kind != "rows":
            if self.row_bytes or el:
                raise self._bad("row_bytes" if self.row_bytes else "engine_layout",
                                "is for kind='rows' only; leave it unset for MHA/MLA")
            return
        if self.row_bytes < 1:
            raise self._bad("row_bytes", "kind='rows' needs row_bytes >= 1 (the bytes of one engine row)")
        fixed = dict(num_layers=1, page_size=1, dtype="uint8", num_kv_heads=0, head_dim=0, kv_lora_rank=0,
                     rope_dim=0, extra_planes=(), draft_layers=0)
        for name, want in fixed.items():
            if getattr(self, name) != want:
                raise self._bad(name, f"kind='rows' holds one opaque row per page: {name} must be {want!r} "
                                "(describe the engine's tokens, layers and dtype in engine_layout)")
        try:
            obj = json.loads(el)
        except ValueError as e:
            raise self._bad("engine_layout", f"must be a JSON object ({e})") from None
        if not isinstance(obj, dict) or not obj:
            raise self._bad("engine_layout", "must be a non-empty JSON object describing the engine's row")
        if canonical_json(obj) != el:
            raise self._bad("engine_layout", "must be canonical JSON (hicache.core.layout.canonical_json: sorted "
                            "keys, no spaces), so that one description has one fingerprint")

    def _unset_rows_fields(self) -> tuple[str, ...]:
        """The rows-only fields, for layouts of another kind (left out of fingerprint and dict)."""
        return () if self.kind == "rows" else _ROWS_ONLY

    @classmethod
    def rows(cls, model_id: str, row_bytes: int, engine_layout: dict, **common: object) -> "KVLayout":
        """A ``kind="rows"`` layout: pages are opaque engine rows of ``row_bytes``
        bytes, described by ``engine_layout`` (any JSON object; canonicalised)."""
        try:
            text = canonical_json(engine_layout)
        except (TypeError, ValueError) as e:
            raise LayoutError(f"KVLayout.engine_layout: not JSON-serialisable ({e})", "engine_layout",
                              engine_layout, "not JSON") from None
        return cls(model_id=model_id, num_layers=1, kind="rows", row_bytes=row_bytes, engine_layout=text,
                   dtype="uint8", page_size=1, **common)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ planes
    def _layer_planes(self) -> list[tuple[str, tuple[int, ...], str, int]]:
        st, size = _DTYPES[self.dtype]
        if self.kind == "rows":
            return [("row", (self.row_bytes,), "uint8", self.row_bytes)]
        if self.kind == "mha":
            row = (self.num_kv_heads, self.head_dim)
            out = [("k", row, st, size * row[0] * row[1]), ("v", row, st, size * row[0] * row[1])]
        else:
            d = self.kv_lora_rank + self.rope_dim
            out = [("latent", (d,), st, size * d)]
        out += [(p.name, (p.bytes_per_token,), "uint8", p.bytes_per_token) for p in self.extra_planes]
        return out

    def _build_planes(self) -> tuple[PlaneSpec, ...]:
        per_layer = self._layer_planes()
        specs: list[PlaneSpec] = []
        for draft, layers in ((False, self.num_layers), (True, self.draft_layers)):
            for layer in range(layers):
                for name, row, dt, rb in per_layer:
                    specs.append(PlaneSpec(len(specs), ("draft_" if draft else "") + name, layer,
                                           draft, row, dt, rb, rb * self.page_size))
        return tuple(specs)

    @property
    def planes(self) -> tuple[PlaneSpec, ...]:
        """Every (plane, layer) of a page, in canonical order: target then draft."""
        return self._planes

    @cached_property
    def page_bytes(self) -> int:
        """Bytes of one page across every plane (target and draft)."""
        return sum(p.page_bytes for p in self._planes)

    @cached_property
    def token_bytes(self) -> int:
        return sum(p.row_bytes for p in self._planes)

    def host_addressing(self, num_pages: int) -> tuple[list[int], list[int], int]:
        """Where an L2 pool of ``num_pages`` keeps each plane, in bytes:
        ``(plane_offset, page_stride, total_bytes)``. Every region starts
        ``HOST_ALIGN``-aligned so typed views and wide kernel loads stay aligned
        whatever odd-sized byte planes sit before them (gaps hold no data)."""
        def up(x: int) -> int:
            return -(-x // HOST_ALIGN) * HOST_ALIGN

        offs, strides, acc = [], [], 0
        if self.host_layout == "layer_first":
            for s in self._planes:
                offs.append(acc)
                strides.append(s.page_bytes)
                acc = up(acc + s.page_bytes * num_pages)
            return offs, strides, acc
        for s in self._planes:
            offs.append(acc)
            acc = up(acc + s.page_bytes)
        return offs, [acc] * len(offs), acc * num_pages

    def planes_of_layer(self, layer: int, draft: bool = False) -> tuple[PlaneSpec, ...]:
        return tuple(p for p in self._planes if p.layer == layer and p.draft == draft)

    # ------------------------------------------------------------- fingerprint
    def contract_fields(self) -> dict[str, object]:
        """The fields that decide a page's bytes, JSON-ready, in a fixed order."""
        out: dict[str, object] = {"contract_version": CONTRACT_VERSION}
        for f in dataclasses.fields(self):
            if f.name.startswith("_") or f.name in _NOT_IN_FINGERPRINT or f.name in self._unset_rows_fields():
                continue
            v = getattr(self, f.name)
            if f.name == "groups":
                if v:  # absent for non-hybrid layouts: their fingerprints stay what they were
                    out["groups"] = [g.to_list() for g in v]
                continue
            if f.name == "engine_cells" and not v:  # likewise for the default cell order
                continue
            out[f.name] = [[p.name, p.bytes_per_token] for p in v] if f.name == "extra_planes" else v
        return out

    @cached_property
    def _fingerprint(self) -> str:
        blob = json.dumps(self.contract_fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()

    def fingerprint(self) -> str:
        """32 hex chars; stable across processes, machines and hash seeds."""
        return self._fingerprint

    def diff(self, other: "KVLayout", *, fields: str = "contract") -> list[tuple[str, object, object]]:
        """``(field, ours, theirs)`` for each differing field.

        ``fields="contract"`` compares what the fingerprint covers;
        ``"shared_l2"`` also compares ``host_layout``; ``"all"`` everything.
        """
        out = []
        for f in dataclasses.fields(self):
            if f.name.startswith("_"):
                continue
            if fields == "contract" and f.name in _NOT_IN_FINGERPRINT:
                continue
            if fields == "shared_l2" and f.name in ("cp_rank", "cp_size"):
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out.append((f.name, a, b))
        return out

    def check_compatible(self, other: "KVLayout", *, shared_l2: bool = False) -> None:
        """Raise ``ContractMismatch`` naming every differing field, else return."""
        d = self.diff(other, fields="shared_l2" if shared_l2 else "contract")
        if d:
            raise ContractMismatch(f"layout {self.model_id!r} vs {other.model_id!r}", d)

    # ------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict[str, object]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if not f.name.startswith("_") and f.name not in self._unset_rows_fields()}
        d["extra_planes"] = [[p.name, p.bytes_per_token] for p in self.extra_planes]
        del d["groups"]
        if not self.engine_cells:
            del d["engine_cells"]
        if self.groups:  # only hybrids carry it: other layouts' dicts (handshakes, stats) are unchanged
            d["groups"] = [g.to_list() for g in self.groups]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        known = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        unknown = set(d) - known
        if unknown:
            raise LayoutError(f"unknown KVLayout field(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)  # __post_init__ normalises extra_planes

    def replace(self, **changes) -> "KVLayout":
        d = self.to_dict()
        d.update(changes)
        return KVLayout.from_dict(d)
