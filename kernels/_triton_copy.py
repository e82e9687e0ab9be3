"""The one Triton kernel behind every page copy and row store.

Work is a list of *units*: pair ``i`` (a source page/row id and a destination
page/slot id) times chunk entry ``r`` of an address table. Entry ``r`` says
where the chunk starts in page 0 of its plane on each side, how far apart the
pages of that plane are, and how long it is::

    src = anchor + SRC[r] + src_idx[i] * SRC_STRIDE[r]
    dst = anchor + DST[r] + dst_idx[i] * DST_STRIDE[r]
    copy LEN[r]

``anchor`` is the address of the table tensor itself: every base is stored
relative to it (possibly negative), so device buffers, pinned host memory
(mapped into the GPU's address space by UVA) and, under ``TRITON_INTERPRET=1``,
CPU tensors are all plain pointer arithmetic from one 16-byte-aligned kernel
argument. (An int-to-pointer cast would lose the alignment the compiler needs
to emit 128-bit accesses; an aligned argument plus a multiple of 4 words keeps
it without any hint.)

Entries whose bases, strides and length are all multiples of 16 bytes sit in
the *wide* table, in 16-byte units, and move as int32 words four at a time;
the rest (odd-sized byte planes) sit in the *narrow* table, in bytes, and move
byte by byte. One launch walks both. The grid is persistent: program ``p``
handles tiles ``p, p + grid, ...``.

With ``SIGNAL`` the launch also says when it is complete, without an event: each
program, after its last tile, adds one to a counter in device memory; the last
of them resets the counter and writes the launch's epoch (read from device
memory) to a flag, which may live in pinned host memory. Another stream waits
for the flag with a stream memory operation (``hicache.transfer.load_graph``) and the
host reads it directly. The counter's release/acquire orders every program's
stores before the flag's write.
"""
from __future__ import annotations

import triton
import triton.language as tl

# Columns of an address-table row (int64). Wide table: 16-byte units; narrow
# table: bytes. SRC and DST are relative to the table's own address.
SRC, SRC_STRIDE, DST, DST_STRIDE, LEN = range(5)
from hicache.kernels.plan import NCOLS  # noqa: E402,F401 (== 5; plan.py builds the tables)


@triton.jit
def _page_copy_kernel(
    wide_ptr,  # int32 view of the int64 [t_wide, NCOLS] wide table; also the anchor
    narrow_ptr,  # int64 [t_narrow, NCOLS] narrow table (unused unless HAS_NARROW)
    src_idx_ptr,  # int64 [n] source page (or row) id of each pair
    dst_idx_ptr,  # int64 [n] destination page (or slot) id of each pair
    keep_ptr,  # [n] provenance codes; only pairs with code 0 (VALID) move (unused unless HAS_KEEP)
    n_ptr,  # int64 [1]: the number of pairs, read on the device (unused unless N_FROM_PTR)
    sig_cnt_ptr,  # int64 [1], zero between launches: programs done (unused unless SIGNAL)
    sig_flag_ptr,  # int64 [1]: set to *sig_epoch_ptr once every program is done (unused unless SIGNAL)
    sig_epoch_ptr,  # int64 [1]: this launch's epoch (unused unless SIGNAL)
    n,  # number of pairs (unless N_FROM_PTR)
    t_wide,  # wide entries per pair
    t_narrow,  # narrow entries per pair
    ROWS: tl.constexpr,  # wide units per tile
    WORDS: tl.constexpr,  # int32 words per wide unit (power of two >= every wide LEN * 4)
    NROWS: tl.constexpr,  # narrow units per tile
    NBYTES: tl.constexpr,  # bytes per narrow unit (power of two >= every narrow LEN)
    HAS_NARROW: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    N_FROM_PTR: tl.constexpr,  # the pair count lives in device memory (CUDA-graph replays)
    SIGNAL: tl.constexpr,  # write the epoch to the flag when the whole launch is done
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    table = wide_ptr.to(tl.pointer_type(tl.int64))
    rows = tl.arange(0, ROWS)
    words = tl.arange(0, WORDS)
    if N_FROM_PTR:
        n_pairs = tl.load(n_ptr)
    else:
        n_pairs = n
    n_units = n_pairs * t_wide
    # while, not range(): Triton 3.6's interpreter cannot turn a program id
    # into a Python int under numpy 2.x; both compile to the same loop.
    start = pid * ROWS
    while start < n_units:
        u = start + rows
        live = u < n_units
        i = u // t_wide
        e = table + (u % t_wide) * 5
        if HAS_KEEP:
            live = live & (tl.load(keep_ptr + i, mask=live, other=1) == 0)
        sp = tl.load(src_idx_ptr + i, mask=live, other=0)
        dp = tl.load(dst_idx_ptr + i, mask=live, other=0)
        # Offsets in 16-byte units times 4 words: provably 16-byte aligned, so
        # each thread moves 4 words with one 128-bit load and one store.
        src = (tl.load(e + 0, mask=live, other=0) + sp * tl.load(e + 1, mask=live, other=0)) * 4
        dst = (tl.load(e + 2, mask=live, other=0) + dp * tl.load(e + 3, mask=live, other=0)) * 4
        nw = tl.load(e + 4, mask=live, other=0) * 4
        m = words[None, :] < nw[:, None]
        data = tl.load(wide_ptr + src[:, None] + words[None, :], mask=m)
        tl.store(wide_ptr + dst[:, None] + words[None, :], data, mask=m)
        start += nprog * ROWS
    if HAS_NARROW:
        anchor = wide_ptr.to(tl.pointer_type(tl.uint8))
        nrows = tl.arange(0, NROWS)
        nbytes = tl.arange(0, NBYTES)
        n_units = n_pairs * t_narrow
        start = pid * NROWS
        while start < n_units:
            u = start + nrows
            live = u < n_units
            i = u // t_narrow
            e = narrow_ptr + (u % t_narrow) * 5
            if HAS_KEEP:
                live = live & (tl.load(keep_ptr + i, mask=live, other=1) == 0)
            sp = tl.load(src_idx_ptr + i, mask=live, other=0)
            dp = tl.load(dst_idx_ptr + i, mask=live, other=0)
            src = tl.load(e + 0, mask=live, other=0) + sp * tl.load(e + 1, mask=live, other=0)
            dst = tl.load(e + 2, mask=live, other=0) + dp * tl.load(e + 3, mask=live, other=0)
            nb = tl.load(e + 4, mask=live, other=0)
            m = nbytes[None, :] < nb[:, None]
            data = tl.load(anchor + src[:, None] + nbytes[None, :], mask=m)
            tl.store(anchor + dst[:, None] + nbytes[None, :], data, mask=m)
            start += nprog * NROWS
    if SIGNAL:
        tl.debug_barrier()  # every thread of this program has issued its stores
        done = tl.atomic_add(sig_cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if done == nprog - 1:  # the last program: every other one released its stores before counting
            tl.store(sig_cnt_ptr, 0)  # ready for the next launch (a stream runs them in order)
            tl.store(sig_flag_ptr, tl.load(sig_epoch_ptr))
