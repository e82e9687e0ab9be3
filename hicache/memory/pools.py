"""L1 device pool and L2 host pool: page-addressed buffers for every plane.

Device pool (L1): one buffer per plane (see ``KVLayout.planes``) shaped
``[num_pages * page_size, *row_shape]`` so an engine's attention kernels can
index it by slot id (``page * page_size + offset``). A page of a plane is
contiguous: ``page_bytes`` bytes at ``page * page_bytes``. An engine's paged
tensors may instead be registered as strided page views (``memory.paged_kv``);
kernels then address every plane through ``DevicePool.byte_pages``.
The L2 host pool's two layouts are on ``HostPool``.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from hicache.memory.allocator import PageAllocator
from hicache.core.errors import IntegrityError, PoolError
from hicache.core.layout import HOST_ALIGN, KVLayout, PlaneSpec  # noqa: F401 (HOST_ALIGN: re-exported)


def cuda_available() -> bool:
    return torch.cuda.is_available()


class DevicePool:
    """L1: per-plane device buffers, allocated here or registered from the engine.

    ``buffers`` (optional) maps ``(plane name, layer)`` to engine-owned tensors;
    they are validated (shape, dtype, contiguity, one device) and used in place.
    A buffer may also be a *page view* ``[num_pages, page_size, *row_shape]``
    with any strides whose last one is 1 (an engine's paged KV, K and V
    interleaved, head-major blocks, pages apart by a block stride: see
    ``memory.paged_kv``); such a pool is ``strided`` and takes no row stores.
    Where pages and tokens merge (vLLM's NHD interiors) the plane is kept as a
    strided row view ``[num_pages * page_size, *row_shape]``, else as the page view.
    CPU tensors stand in for GPU tensors in tests.
    """

    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device = "cpu",
                 buffers: Mapping[tuple[str, int], torch.Tensor] | None = None):
        if num_pages < 1:
            raise PoolError(f"device pool needs num_pages >= 1, got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.allocator = PageAllocator(num_pages, "L1")
        rows = num_pages * layout.page_size
        self.buffers: list[torch.Tensor] = []
        for spec in layout.planes:
            if buffers is None:
                t = torch.zeros((rows, *spec.row_shape), dtype=spec.dtype, device=self.device)
            else:
                t = self._check_registered(spec, buffers, rows)
            self.buffers.append(t)
        self._by_name = {(s.name, s.layer): i for i, s in enumerate(layout.planes)}
        # True when some plane is strided: no row stores (the engine writes its own KV). A plane
        # whose pages and tokens do not merge into rows stays a page view: no slot indexing either.
        self.strided = any(not t.is_contiguous() for t in self.buffers)
        self._bytes = [_byte_pages(t, num_pages, layout.page_size, s) for s, t in zip(layout.planes, self.buffers)]

    def _check_registered(self, spec: PlaneSpec, buffers, rows: int) -> torch.Tensor:
        key = (spec.name, spec.layer)
        if key not in buffers:
            raise PoolError(f"registered buffers lack plane {key}; expected every plane of "
                            f"the layout: {[(s.name, s.layer) for s in self.layout.planes]}")
        t = buffers[key]
        want = (rows, *spec.row_shape)
        paged = (self.num_pages, self.layout.page_size, *spec.row_shape)
        if tuple(t.shape) not in (want, paged) or t.dtype != spec.dtype:
            raise PoolError(f"plane {key}: got shape {tuple(t.shape)} dtype {t.dtype}, "
                            f"layout needs {want} (or a page view {paged}) {spec.dtype}")
        if t.device != self.device:
            raise PoolError(f"plane {key}: buffer is on {t.device}, the pool on {self.device}")
        if tuple(t.shape) == want and not t.is_contiguous():
            raise PoolError(f"plane {key}: a row buffer must be contiguous (strides {t.stride()}); "
                            f"register strided KV as a page view {paged}")
        if t.stride(-1) != 1 and not self.layout.engine_cells:
            raise PoolError(f"plane {key}: a page view needs a contiguous last dim, got strides {t.stride()}")
        if tuple(t.shape) == paged and t.stride(0) == t.stride(1) * t.shape[1]:
            return t.flatten(0, 1)  # pages then tokens merge into rows (a view): slot-addressable
        return t

    def byte_pages(self, plane: int) -> torch.Tensor:
        """``uint8 [num_pages, *dims]`` view (no copy) of one plane: row-major order over
        ``dims`` is the plane's canonical page bytes, the last dim is contiguous, and
        mergeable dims are merged (a contiguous plane is ``[num_pages, page_bytes]``)."""
        return self._bytes[plane]

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def plane(self, name: str, layer: int) -> torch.Tensor:
        """The full buffer of one plane; valid for the pool's lifetime."""
        return self.buffers[self._by_name[(name, layer)]]

    def page_view(self, page: int) -> dict[tuple[str, int], torch.Tensor]:
        """Views (no copy) of one page's rows on every plane, ``[page_size, *row_shape]``."""
        ps = self.page_size
        return {(s.name, s.layer): (self.buffers[s.index][page] if self._is_paged(s.index) else
                                    self.buffers[s.index][page * ps:(page + 1) * ps])
                for s in self.layout.planes}

    def _is_paged(self, plane: int) -> bool:
        return self.buffers[plane].dim() == 2 + len(self.layout.planes[plane].row_shape)

    def layer_view(self, layer: int, draft: bool = False) -> dict[str, torch.Tensor]:
        """Every plane buffer of one layer, keyed by plane name."""
        return {s.name: self.buffers[s.index] for s in self.layout.planes_of_layer(layer, draft)}

    def slot_ids(self, pages: list[int]) -> torch.Tensor:
        """Slot (row) ids of whole pages, in page order."""
        ps = self.page_size
        p = torch.as_tensor(pages, dtype=torch.int64)
        return (p[:, None] * ps + torch.arange(ps)).reshape(-1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        for s, t, b in zip(self.layout.planes, self.buffers, self._bytes):
            shapes = ((self.num_pages * self.page_size, *s.row_shape), (self.num_pages, self.page_size, *s.row_shape))
            if tuple(t.shape) not in shapes or t.dtype != s.dtype:
                raise IntegrityError(f"L1 plane {(s.name, s.layer)} changed shape/dtype to "
                                     f"{tuple(t.shape)} {t.dtype}")
            if b.numel() != self.num_pages * s.page_bytes or b.data_ptr() != t.data_ptr():
                raise IntegrityError(f"L1 plane {(s.name, s.layer)}: its byte view covers {b.numel()} bytes at "
                                     f"{b.data_ptr():#x}, the buffer {self.num_pages * s.page_bytes} at {t.data_ptr():#x}")


def _byte_pages(t: torch.Tensor, num_pages: int, page_size: int, spec: PlaneSpec) -> torch.Tensor:
    """``uint8 [num_pages, *dims]`` over buffer ``t`` (rows or page view), dims merged where
    the strides allow; row-major order over dims is the canonical page order."""
    paged = t.unflatten(0, (num_pages, page_size)) if t.dim() == 1 + len(spec.row_shape) else t
    if paged.stride(-1) == 1:
        u = paged.view(torch.uint8)
    else:  # an engine's transposed plane (``KVLayout.engine_cells``): one more dim, each element's bytes
        e = paged.element_size()
        raw = torch.empty(0, dtype=torch.uint8, device=paged.device).set_(paged.untyped_storage())
        u = raw.as_strided((*paged.shape, e), (*(x * e for x in paged.stride()), 1), paged.storage_offset() * e)
    shape, stride = [u.shape[-1]], [1]
    for n, st in zip(reversed(u.shape[1:-1]), reversed(u.stride()[1:-1])):
        if n == 1:
            continue
        if st == stride[0] * shape[0]:
            shape[0] *= n
        else:
            shape.insert(0, n)
            stride.insert(0, st)
    return u.as_strided((num_pages, *shape), (u.stride(0), *stride))


class HostPool:
    """L2: one flat uint8 buffer addressed per (plane, page), in either layout.

    Pinned when CUDA is present (so GPU kernels can address it directly),
    plain otherwise. ``buffer`` (optional) supplies the memory, e.g. a shared
    memory segment in service mode; it must hold ``nbytes_for(...)`` bytes.

    Host pool (L2): one flat uint8 buffer. The bytes of (plane ``i``, page ``p``)
    start at ``plane_offset[i] + p * page_stride[i]``:

    * ``layer_first``: plane after plane, ``[plane, page, rows]``:
      ``plane_offset[i]`` = sum of earlier planes' regions, ``page_stride[i]`` =
      the plane's ``page_bytes``;
    * ``page_first``: page after page, ``[page, plane, rows]``: ``plane_offset[i]``
      = the plane's offset inside a page, ``page_stride[i]`` = ``layout.page_bytes``;
      a whole page is one contiguous region (zero-copy L3 I/O).

    Kernels use exactly these two arrays, so one kernel serves both layouts.
    """

    def __init__(self, layout: KVLayout, num_pages: int, *, pin: bool | None = None,
                 buffer: torch.Tensor | None = None):
        if num_pages < 1:
            raise PoolError(f"host pool needs num_pages >= 1, got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.allocator = PageAllocator(num_pages, "L2")
        need = self.nbytes_for(layout, num_pages)
        if buffer is None:
            pin = cuda_available() if pin is None else pin
            buffer = torch.zeros(need, dtype=torch.uint8, pin_memory=pin)
        elif buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < need:
            raise PoolError(f"host buffer must be 1-D uint8 of >= {need} bytes, got "
                            f"{buffer.dtype} shape {tuple(buffer.shape)}")
        self.buffer = buffer[:need]
        self.plane_offset, self.page_stride, _ = self.addressing(layout, num_pages)
        self._bytes: memoryview | None = None  # the buffer as bytes, made on the first page_buffers()

    @staticmethod
    def nbytes_for(layout: KVLayout, num_pages: int) -> int:
        return HostPool.addressing(layout, num_pages)[2]

    @staticmethod
    def addressing(layout: KVLayout, num_pages: int) -> tuple[list[int], list[int], int]:
        """``(plane_offset, page_stride, total_bytes)``: see ``KVLayout.host_addressing``."""
        return layout.host_addressing(num_pages)

    @property
    def pinned(self) -> bool:
        return self.buffer.is_pinned()

    def plane_page(self, plane: int, page: int) -> torch.Tensor:
        """View of one page of one plane, typed ``[page_size, *row_shape]``."""
        s = self.layout.planes[plane]
        start = self.plane_offset[plane] + page * self.page_stride[plane]
        raw = self.buffer[start:start + s.page_bytes]
        return raw.view(s.dtype).view(self.layout.page_size, *s.row_shape)

    def page_view(self, page: int) -> dict[tuple[str, int], torch.Tensor]:
        """Typed views (no copy) of every plane of one page."""
        return {(s.name, s.layer): self.plane_page(s.index, page) for s in self.layout.planes}

    def page_region(self, page: int) -> torch.Tensor:
        """The page's contiguous uint8 region (``page_first`` only; may end in alignment pad)."""
        if self.layout.host_layout != "page_first":
            raise PoolError("page_region() needs host_layout='page_first'; use read_page() to gather")
        b = self.page_stride[0]
        return self.buffer[page * b:(page + 1) * b]

    def page_buffers(self, page: int) -> list[memoryview]:
        """Writable flat byte views (no copy) of one page's planes in canonical order: the
        L3 payload's segments, one region in ``page_first``. Valid while the pool lives;
        writing them writes the page (an L3 read lands there with no copy)."""
        mv = self._bytes
        if mv is None:
            mv = self._bytes = memoryview(self.buffer.numpy())
        if self.layout.host_layout == "page_first" and self.page_stride[0] == self.layout.page_bytes:
            at = page * self.page_stride[0]
            return [mv[at:at + self.layout.page_bytes]]
        return [mv[o + page * st:o + page * st + s.page_bytes]
                for o, st, s in zip(self.plane_offset, self.page_stride, self.layout.planes)]

    def read_page(self, page: int) -> bytes:
        """The page in canonical plane order (the L3 payload). Copies."""
        if self.layout.host_layout == "page_first" and self.page_stride[0] == self.layout.page_bytes:
            return self.page_region(page).numpy().tobytes()
        return b"".join(self._raw(i, page).numpy().tobytes() for i in range(len(self.layout.planes)))

    def write_page(self, page: int, payload: "bytes | memoryview | torch.Tensor") -> None:
        """Store a canonical-order payload (bytes, or a CPU uint8 tensor) into one page."""
        if isinstance(payload, torch.Tensor):
            payload = payload.detach().reshape(-1).view(torch.uint8).numpy()
        if len(payload) != self.layout.page_bytes:
            raise PoolError(f"payload of {len(payload)} bytes, a page holds {self.layout.page_bytes}")
        # numpy, not torch: torch's copy_ splits a region over its intra-op threads once it
        # passes its grain size (32 K elements), so a whole page_first page (MiBs) woke
        # them while L3 reads ran; on a 2-core box beside a loopback Redis that made
        # page_first loads 3-4x slower than layer_first's small per-plane copies
        # (bench/engines.py --sglang, RESULTS.md). numpy copies on the calling thread,
        # straight from the payload (no bytearray copy first).
        src = np.frombuffer(payload, dtype=np.uint8)
        if self.layout.host_layout == "page_first" and self.page_stride[0] == self.layout.page_bytes:
            self.page_region(page).numpy()[:] = src
            return
        at = 0
        for i, s in enumerate(self.layout.planes):
            self._raw(i, page).numpy()[:] = src[at:at + s.page_bytes]
            at += s.page_bytes

    def _raw(self, plane: int, page: int) -> torch.Tensor:
        start = self.plane_offset[plane] + page * self.page_stride[plane]
        return self.buffer[start:start + self.layout.planes[plane].page_bytes]

    def layer_view(self, layer: int, draft: bool = False) -> dict[str, torch.Tensor]:
        """Every plane of one layer over all pages, typed ``[num_pages, page_size, *row_shape]``.

        Contiguous in ``layer_first``, strided (one page stride apart) in ``page_first``.
        """
        out = {}
        for s in self.layout.planes_of_layer(layer, draft):
            esz = torch.empty((), dtype=s.dtype).element_size()
            off, stride = self.plane_offset[s.index], self.page_stride[s.index]
            assert off % esz == 0 and stride % esz == 0 and self.buffer.numel() % esz == 0, (s, off, stride)
            row_strides, acc = [], 1
            for d in reversed(s.row_shape):
                row_strides.insert(0, acc)
                acc *= d
            out[s.name] = self.buffer.view(s.dtype).as_strided(
                (self.num_pages, self.layout.page_size, *s.row_shape),
                (stride // esz, s.row_bytes // esz, *row_strides), off // esz)
        return out

    def nbytes(self) -> int:
        return self.buffer.numel()

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        regions = sorted((self.plane_offset[i] + p * self.page_stride[i], s.page_bytes)
                         for i, s in enumerate(self.layout.planes) for p in (0, self.num_pages - 1))
        end = max(o + n for o, n in regions)
        if end > self.buffer.numel():
            raise IntegrityError(f"L2 addressing reaches byte {end} beyond buffer {self.buffer.numel()}")
