"""PyTorch's CPU random stream, drawn by a vectorized TVM kernel (for dropout masks).

``F.dropout`` on CPU draws its mask with ``empty_like(x).bernoulli_(1-p)``: a serial loop over
the default generator (MT19937), two 32-bit words per element (``random64``), ``uniform < p`` in
double; in a training step that loop costs more than many of TVM's kernels together (the README
has the measurement). The words of a Mersenne Twister block do not depend on each
other, so the same stream can be produced a block (624 words) at a time with vector
instructions: :func:`bernoulli_` twists and tempers the generator's state in a TVM kernel, turns
word pairs into the same 0/1 values, and writes the advanced state back into PyTorch's generator.
The masks and the generator afterwards are bit-identical to ``Tensor.bernoulli_``.

This relies on the layout of ``torch.get_rng_state()`` (the legacy ``THGeneratorState``) and on
ATen's CPU bernoulli algorithm. :func:`kernel_works` checks both once per process against
``Tensor.bernoulli_`` itself (across a twist boundary, masks and generator state); where they do
not match, callers keep PyTorch's ``bernoulli_``: never a different mask.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
import torch
import tvm
import tvm_ffi
from tvm.script import tirx as T

from ..devices import prepare_cpu_runtime, target_for
from .library import cached_kernel_library

N, M = 624, 397  # MT19937 state words, shift
_STATE_BYTES = 5056  # sizeof(CPUGeneratorImplStateLegacy)
_LEFT, _NEXT, _STATE = 8, 16, 24  # byte offsets of left (int32), next (uint64), state (uint64[624])

# Below this many elements PyTorch's serial loop beats the kernel's fixed cost (the generator
# state's round trip, waking TVM's threads).
MIN_ELEMENTS = 1 << 16

_STATE_LOCK = threading.Lock()  # the generator state is read, advanced and written back as one step


def _temper(y):
    """MT19937 output tempering of one word (a TIR expression)."""
    y = y ^ (y >> T.uint32(11))
    y = y ^ ((y << T.uint32(7)) & T.uint32(0x9D2C5680))
    y = y ^ ((y << T.uint32(15)) & T.uint32(0xEFC60000))
    return y ^ (y >> T.uint32(18))


def _twist(u, v, far):
    """One word of ATen's ``next_state``: ``far ^ twist(u, v)``."""
    mixed = (u & T.uint32(0x80000000)) | (v & T.uint32(0x7FFFFFFF))
    odd = T.Select((v & T.uint32(1)) != T.uint32(0), T.uint32(0x9908B0DF), T.uint32(0))
    return far ^ (mixed >> T.uint32(1)) ^ odd


def _keep(hi, lo, th_hi, th_lo):
    """ATen's ``bernoulli_distribution<double>``: with ``bits = (hi << 32 | lo) & (2^53 - 1)``,
    ``bits * 2^-53 < p`` (both sides exact in double), i.e. ``bits < ceil(p * 2^53)`` as
    integers, compared as (high 21 bits, low 32 bits) pairs: all 32-bit vector lanes."""
    hi = hi & T.uint32(0x1FFFFF)
    below = T.Or(hi < th_hi, T.And(hi == th_hi, lo < th_lo))
    return T.Select(below, T.float32(1), T.float32(0))  # Select: no branch (if_then_else branches)


def _build():
    """The kernel: ``out[i] = (uniform64(word[2i], word[2i+1]) < p)``, the words being the
    generator's next ``2n``: ``avail`` left in ``state`` from ``start``, then ``nblocks`` twists
    (``state`` ends as the generator's state after them)."""

    @T.prim_func
    def mt_bernoulli(
        state_in: T.Buffer((624,), "uint32"),
        state: T.Buffer((624,), "uint32"),
        start: T.int64,
        avail: T.int64,
        nblocks: T.int64,
        th_hi: T.uint32,
        th_lo: T.uint32,
        words_h: T.handle,
        out_h: T.handle,
    ):
        T.func_attr({"global_symbol": "mt_bernoulli", "tirx.noalias": True})
        w = T.int64()
        n = T.int64()
        words = T.match_buffer(words_h, (w,), "uint32")
        out = T.match_buffer(out_h, (n,), "float32")
        for i in T.vectorized(624):
            state[i] = state_in[i]
        for i in range(avail):
            words[i] = _temper(state[start + i])
        for b in range(nblocks):
            # twist, in ATen's order (next_state); vectors of 16 are exact here: a run reads
            # words not yet rewritten (i+1, i+397) or rewritten >= 227 words earlier (i-227)
            for c in range(14):  # i in [0, 224)
                for lane in T.vectorized(16):
                    state[c * 16 + lane] = _twist(
                        state[c * 16 + lane], state[c * 16 + lane + 1], state[c * 16 + lane + 397]
                    )
            for i in range(224, 227):
                state[i] = _twist(state[i], state[i + 1], state[i + 397])
            for c in range(24):  # i in [227, 611)
                for lane in T.vectorized(16):
                    state[227 + c * 16 + lane] = _twist(
                        state[227 + c * 16 + lane], state[228 + c * 16 + lane], state[c * 16 + lane]
                    )
            for i in range(611, 623):
                state[i] = _twist(state[i], state[i + 1], state[i - 227])
            state[623] = _twist(state[623], state[0], state[396])
            for c in range(39):
                for lane in T.vectorized(16):
                    words[avail + b * 624 + c * 16 + lane] = _temper(state[c * 16 + lane])
        # element i: random64 = words[2i] << 32 | words[2i+1] (ATen's random64)
        for c in T.parallel(n // 16):
            for lane in T.vectorized(16):
                out[c * 16 + lane] = _keep(words[2 * (c * 16 + lane)], words[2 * (c * 16 + lane) + 1], th_hi, th_lo)
        for i in range(n // 16 * 16, n):
            out[i] = _keep(words[2 * i], words[2 * i + 1], th_hi, th_lo)

    return mt_bernoulli


@functools.cache
def _kernel():
    """The compiled kernel (once per process, on first use; from the disk cache where an earlier
    process built it)."""

    def make() -> tvm.IRModule:
        return tvm.IRModule({"mt_bernoulli": _build()})

    prepare_cpu_runtime()
    return cached_kernel_library("mt_bernoulli", make, target_for(torch.device("cpu")))["mt_bernoulli"]


def bernoulli_(out: torch.Tensor, p: float) -> torch.Tensor:
    """``out.bernoulli_(p)`` on the default CPU generator, for a contiguous float32 ``out``:
    the same values and the same generator state afterwards (see the module docstring)."""
    if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError("rng.bernoulli_ takes a contiguous float32 CPU tensor")
    n = out.numel()
    if n == 0:
        return out
    with _STATE_LOCK:
        raw = torch.get_rng_state()
        buf = raw.numpy()
        left = int(np.frombuffer(buf[_LEFT : _LEFT + 4].tobytes(), "<i4")[0])
        nxt = int(np.frombuffer(buf[_NEXT : _NEXT + 8].tobytes(), "<u8")[0])
        state = np.frombuffer(buf[_STATE : _STATE + 8 * N].tobytes(), "<u8").astype(np.uint32)
        avail = left - 1  # draws before the generator twists (it twists lazily, on the next one)
        if not 0 <= avail <= N - nxt:
            raise RuntimeError(f"unexpected CPU generator state (left={left}, next={nxt})")
        need = 2 * n
        first = min(avail, need)
        blocks = -(-(need - first) // N)
        words = torch.empty(first + blocks * N, dtype=torch.uint32)
        new_state = torch.empty(N, dtype=torch.uint32)
        threshold = math.ceil(float(p) * 2.0**53)  # exact: scaling a double by 2^53
        _kernel()(
            tvm_ffi.from_dlpack(torch.from_numpy(state).clone()),  # clone: 64-byte aligned, as TVM assumes
            tvm_ffi.from_dlpack(new_state),
            nxt,
            first,
            blocks,
            threshold >> 32,
            threshold & 0xFFFFFFFF,
            tvm_ffi.from_dlpack(words),
            tvm_ffi.from_dlpack(out.view(-1)),
        )
        if blocks == 0:
            left, nxt = left - need, nxt + need
        else:
            used = need - first - (blocks - 1) * N  # words taken from the last block, 1..624
            left, nxt = N + 1 - used, used
            new = np.frombuffer(buf[_STATE : _STATE + 8 * N].tobytes(), "<u8").copy()
            new[:] = new_state.numpy()
            buf[_STATE : _STATE + 8 * N] = np.frombuffer(new.tobytes(), np.uint8)
        buf[_LEFT : _LEFT + 4] = np.frombuffer(np.int32(left).tobytes(), np.uint8)
        buf[_NEXT : _NEXT + 8] = np.frombuffer(np.uint64(nxt).tobytes(), np.uint8)
        torch.set_rng_state(raw)
    return out


@functools.cache
def kernel_works() -> bool:
    """Whether :func:`bernoulli_` reproduces ``Tensor.bernoulli_`` here (checked once: masks
    across a twist boundary and the generator state after them). The caller's generator state is
    left as it was."""
    saved = torch.get_rng_state()
    try:
        ok = torch.get_rng_state().numel() == _STATE_BYTES
        for seed, sizes in ((0, (5, 700, 1)), (1234, (1, 311, 2000))):
            for size in sizes:  # several draws: partial blocks, exact ends, many blocks
                torch.manual_seed(seed)
                torch.rand(size)  # move the stream off a block boundary
                want = torch.empty(size * 3).bernoulli_(0.9)
                after_want = torch.get_rng_state()
                torch.manual_seed(seed)
                torch.rand(size)
                got = bernoulli_(torch.empty(size * 3), 0.9)
                ok = ok and torch.equal(got, want) and torch.equal(torch.get_rng_state(), after_want)
        return bool(ok)
    except Exception:  # noqa: BLE001 - any failure means: keep PyTorch's bernoulli_
        return False
    finally:
        torch.set_rng_state(saved)
