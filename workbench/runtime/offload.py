"""Block inputs parked in host memory, the MLP in tiles of tokens, and blocks swapped instead of
recomputed: what a token keeps on the device under recomputation made smaller, and the
recomputation itself made shorter (MEMO; ALST, Arctic Long Sequence Training).

Under ``--recompute`` every block runs under non-reentrant checkpointing
(``workbench.runtime.zero.apply_recompute``), so per token the device keeps every block's input
(``layers x hidden x bytes``) and, while one block is recomputed and differentiated, that block's
working set, of which the SwiGLU MLP's intermediates (gate, up, silu(gate), their product: ``4 x
ffn`` a token) are the largest part. Two levers remove most of it, for the rows (tokens) of the
groups whose plan says ``offload="inputs"``, and a third trades the recomputation of some blocks
for host memory, for the groups whose plan says ``swap_layers > 0``:

- **Tiled MLP** (:func:`tiled_mlp`, ALST's TiledMLP idea): the block's MLP sublayer
  ``down(silu(gate(n)) * up(n))``, ``n = mlp_norm(h)``, is computed ``tile`` tokens at a time
  without a graph, keeping only the residual stream ``h``; its backward recomputes each tile, the
  norm included, with the graph and back-propagates it before the next, accumulating the weights'
  gradients (the norm's too; in fp32 at least). Every token's arithmetic is that of the plain norm
  and MLP (the same casts autocast would make), so values and gradients are the plain ones up to the
  order of the weight gradients' sums. The norm's tensors (its fp32 input, normed input and output)
  and the MLP's intermediates exist for one tile at a time, never for the whole sequence.
- **Offload** (:class:`OffloadPass`): a ``saved_tensors_hooks`` pair around each block's
  checkpointed forward sees what the checkpoint saves of its inputs and moves the block input
  ``x`` (the big ``(T, hidden)`` tensor; rotary tables and ``cu_seqlens`` are shared by every block
  and stay) to host memory as the block's forward ends: on CUDA into pinned memory by a
  ``non_blocking`` copy on a side stream, so the copy overlaps the next blocks' compute. In
  backward the recomputation of block ``i`` asks for its input; the copy back of block ``i - 1``'s
  input is started then, so it runs while block ``i`` is recomputed and differentiated, and the
  compute stream waits on a copy's event only when it needs that tensor (the wait is measured with
  CUDA events: :attr:`OffloadPass.wait_ms`). The last block's input is never offloaded: backward
  needs it first. So at any time at most two blocks' inputs are on the device: ``(layers - 2) x
  hidden x bytes`` a token fewer than without (``workbench.cost.offload`` prices both levers).

- **Swap instead of recompute** (:meth:`OffloadPass.swapped_block`, MEMO's idea at block
  granularity): under recomputation every block's forward runs twice. A pass that swaps block ``i``
  (a group's ``swap_layers = k`` of ``L`` blocks, evenly spread: ``swap_blocks``) runs that block
  plainly, not checkpointed, with a ``saved_tensors_hooks`` pair that sends every activation its
  backward needs to host memory as the block's forward ends (one copy per storage; parameters,
  their views and casts, the rotary tables and integer tensors stay) and brings it back one block
  ahead in the backward, so the block is never recomputed. Its MLP runs plain: a tiled MLP
  recomputes its tiles, which swapping is there to avoid. The last block, if swapped, keeps its
  activations on the device (its backward comes first). The device then holds at most two
  swapped blocks' activations at a time (the one in use and the one in flight), against a
  recomputed block's input and, while it is recomputed, its working set; the host holds the
  others'. The compute it saves is the swapped blocks' second forward.

On CPU "host memory" is the same memory, but the pass still copies (into buffers made outside any
``workbench.runtime.live.LiveBytes`` count, and back into counted tensors), so a CPU test measures
what the device would keep outside the offload buffers.

Wiring, keeping the model plain: :func:`apply_offload` (after ``apply_recompute``, before
``fully_shard``; ``zero.parallelize`` does it whenever it recomputes) wraps every block's forward so
that, while an :class:`OffloadPass` is active on the model (:func:`offloading`, a context around one
forward and its backward), the block's checkpointed call runs inside that pass's hooks. The tiling
is handed to the model as attention is, as a callable: ``model(..., mlp_fn=op.mlp)``, carried into
every block (and through the checkpoint into its recomputation), which calls it as
``mlp_fn(mlp_norm, mlp, h)`` for its ``mlp(mlp_norm(h))``. A lockstep pass packs several
groups' rows back to back; the pass is built from the row segments and each lever applies only to
its ``offload`` rows. Nothing here communicates: every rank runs the same collectives with or
without it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from workbench.cost.offload import OFFLOAD_LEVELS, mlp_tile_tokens, swap_blocks

__all__ = ["OFFLOAD_LEVELS", "tiled_mlp", "RowMLP", "OffloadPass", "apply_offload", "offloading", "offload_pass",
           "swap_blocks"]


# ---- the tiled MLP --------------------------------------------------------------------------------

def _swiglu(xg: torch.Tensor, xu: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with gate's and up's inputs given apart (the same rows): the
    backward then has their two gradients apart, as autocast's two casts of ``x`` do."""
    return F.linear(F.silu(F.linear(xg, wg)) * F.linear(xu, wu), wd)  # (t, C)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``workbench.runtime.model.RMSNorm``'s arithmetic with its weight given: the statistics in fp32
    at least, the result in ``x``'s dtype times the weight. Autocast changes none of it (its inputs
    are fp32 where it would cast, and it casts no elementwise op), so computed outside autocast it
    is the norm a block computes inside."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # (t, C)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (t, C)
    return xf.type_as(x) * weight  # (t, C)


class _TiledMLP(torch.autograd.Function):
    """The SwiGLU, or the block's whole MLP sublayer ``mlp(norm(x))`` when given the norm's weight
    ``wn``, tile by tile: the forward keeps only the input (the MLP's in the dtype the matmuls read
    it in; the sublayer's as it came, the residual stream) and the weights, which it does not copy;
    the backward recomputes a tile with its graph (the norm included), back-propagates it and drops
    it before the next, so neither the norm's tensors (its fp32 input, normed input and output) nor
    the MLP's intermediates ever exist for more than a tile."""

    @staticmethod
    def forward(ctx, x, wn, wg, wu, wd, tile: int, eps: float):
        dev = x.device.type
        # autocast's casts made explicitly (and remembered for the backward, which runs outside
        # autocast): the weights once for all tiles, where autocast would cast them for every tile
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        with torch.autocast(dev, enabled=False):
            # without the norm what is kept is x as the matmuls read it: under autocast its bf16 copy
            # (2 bytes a value; the plain MLP keeps two, gate's and up's); with it, x itself
            xs = _cast(x, dt) if wn is None else x  # (T, C)
            ws = [_cast(w, dt) for w in (wg, wu, wd)]
            T = x.shape[0]
            out = None
            for a in range(0, T, tile):
                xt = xs[a:a + tile]  # (t, C)
                if wn is not None:
                    xt = _cast(_rms_norm(xt, wn, eps), dt)  # (t, C) the normed tile as gate and up read it
                y = _swiglu(xt, xt, *ws)  # (t, C)
                if out is None:
                    out = y.new_empty((T, y.shape[1]))
                out[a:a + tile] = y
        ctx.cast, ctx.tile, ctx.eps, ctx.x_dtype = dt, tile, eps, x.dtype
        ctx.save_for_backward(xs, wn, wg, wu, wd)
        return out

    @staticmethod
    def backward(ctx, gy):
        xs, wn, wg, wu, wd = ctx.saved_tensors
        dt, tile, eps = ctx.cast, ctx.tile, ctx.eps
        need_x, *need_w = ctx.needs_input_grad[:5]
        weights = (wn, wg, wu, wd)
        need_w = [n and w is not None for w, n in zip(weights, need_w)]
        gx = torch.empty(xs.shape, dtype=ctx.x_dtype, device=xs.device) if need_x else None
        acc = [torch.zeros(w.shape, dtype=torch.promote_types(w.dtype, torch.float32), device=w.device) if n else None
               for w, n in zip(weights, need_w)]
        with torch.enable_grad(), torch.autocast(xs.device.type, enabled=False):
            leaves = [w.detach().requires_grad_(n) if w is not None else None for w, n in zip(weights, need_w)]
            # the matmuls' weights cast once (the casts' backward is not run: gradients are taken at
            # ws); the norm's weight is used as it is, as RMSNorm uses it
            wanted_w = [leaves[0]] + [_cast(w, dt) for w in leaves[1:]]
            for a in range(0, xs.shape[0], tile):
                if wn is None:
                    xg = xs[a:a + tile].detach().requires_grad_(need_x)  # (t, C) gate's input
                    xu = xs[a:a + tile].detach().requires_grad_(need_x)  # (t, C) up's input, the same rows
                    y = _swiglu(xg, xu, *wanted_w[1:])  # (t, C), with its graph: one tile's intermediates
                    inputs = [xg, xu] if need_x else []
                else:
                    xt = xs[a:a + tile].detach().requires_grad_(need_x)  # (t, C) the sublayer's input
                    n = _rms_norm(xt, wanted_w[0], eps)  # (t, C)
                    # two casts, as autocast casts the normed rows once for gate and once for up: their
                    # gradients converted apart and summed, as the plain backward sums them
                    y = _swiglu(_cast(n, dt), _cast(n, dt), *wanted_w[1:])  # (t, C)
                    inputs = [xt] if need_x else []
                wanted = inputs + [w for w, n in zip(wanted_w, need_w) if n]
                grads = list(torch.autograd.grad(y, wanted, gy[a:a + tile]))
                if need_x and wn is None:  # each converted to x's dtype, then summed, as autocast's casts' backward and autograd do
                    gx[a:a + tile] = grads.pop(0).to(ctx.x_dtype) + grads.pop(0).to(ctx.x_dtype)
                elif need_x:
                    gx[a:a + tile] = grads.pop(0)
                for k, n in enumerate(need_w):
                    if n:
                        acc[k] += grads.pop(0)
                del y, grads, wanted, inputs
        gw = [g.to(w.dtype) if g is not None else None for g, w in zip(acc, weights)]
        return gx, *gw, None, None


def _cast(t: torch.Tensor, dt: torch.dtype | None) -> torch.Tensor:
    """As autocast casts a matmul's operands: floating fp32 tensors to ``dt``, others as they are."""
    return t.to(dt) if dt is not None and t.dtype == torch.float32 else t


def tiled_mlp(mlp: nn.Module, x: torch.Tensor, tile: int, *, norm: nn.Module | None = None) -> torch.Tensor:
    """``mlp(x)`` for the model's SwiGLU ``MLP`` (``gate``, ``up``, ``down`` without biases), or with
    ``norm`` (the block's ``RMSNorm``, ``weight`` and ``eps``) the whole sublayer ``mlp(norm(x))``,
    computed ``tile`` tokens at a time (module docstring): ``(T, C) -> (T, C)``, the same values and
    gradients (the norm's weight's included). It uses the weights the modules hold at the call, so
    under FSDP2 it must run inside their unit (the block's forward, or its recomputation in
    backward), where they are the all-gathered ones. Raises ValueError for a tile below 1 or an MLP
    with biases."""
    if int(tile) < 1:
        raise ValueError(f"tiled_mlp: tile must be at least 1 token, got {tile}")
    if any(getattr(mlp, n).bias is not None for n in ("gate", "up", "down")):
        raise ValueError("tiled_mlp: the MLP's projections have biases; the tiled MLP computes the bias-free SwiGLU")
    if x.shape[0] == 0:
        return mlp(x if norm is None else norm(x))
    wn, eps = (None, 0.0) if norm is None else (norm.weight, float(norm.eps))
    return _TiledMLP.apply(x, wn, mlp.gate.weight, mlp.up.weight, mlp.down.weight, int(tile), eps)


def _merge(segments: Sequence[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
    """Adjacent segments of the same kind joined, empty ones dropped."""
    out: list[tuple[int, int, bool]] = []
    for lo, hi, on in segments:
        if hi <= lo:
            continue
        if out and out[-1][2] == bool(on) and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi, bool(on))
        else:
            out.append((int(lo), int(hi), bool(on)))
    return out


class RowMLP:
    """A block's ``mlp_fn`` (``workbench.runtime.model.Block``): ``mlp(norm(x))`` with the rows of
    ``segments`` marked ``True`` through :func:`tiled_mlp` (norm and MLP together) in tiles of
    ``tile`` tokens, the others through the plain norm and MLP, the outputs concatenated in row
    order. ``segments`` are ``(start, stop, tiled)`` and cover the model's input rows."""

    def __init__(self, segments: Sequence[tuple[int, int, bool]], tile: int) -> None:
        if int(tile) < 1:
            raise ValueError(f"RowMLP: tile must be at least 1 token, got {tile}")
        self.segments = _merge(segments)
        self.tile = int(tile)

    def __call__(self, norm: nn.Module, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not any(on for _, _, on in self.segments):
            return mlp(norm(x))
        if len(self.segments) == 1:
            return tiled_mlp(mlp, x, self.tile, norm=norm)
        # a lockstep pass with tiled and plain groups: each part its way (the plain part keeps its
        # intermediates, as it would alone)
        return torch.cat([tiled_mlp(mlp, x[lo:hi], self.tile, norm=norm) if on else mlp(norm(x[lo:hi]))
                          for lo, hi, on in self.segments])


# ---- block inputs in host memory -------------------------------------------------------------------

class _Kept:
    """What the pack hook returns for a block input it leaves on the device (the last block's): the
    tensor, and the layer, so that its unpack can start the copy back of the layer before it."""

    __slots__ = ("layer", "tensor")

    def __init__(self, layer: int, tensor: torch.Tensor) -> None:
        self.layer, self.tensor = layer, tensor


class _Parked:
    """One block input between its forward and its recomputation: the offloaded rows in ``host``
    (one buffer, the row ranges back to back), the other rows in ``kept`` on the device; once its
    copy back is started, ``fetched`` (the device tensor being filled) and ``event`` (CUDA: its
    copy's completion)."""

    __slots__ = ("layer", "shape", "dtype", "device", "host", "kept", "fetched", "event")

    def __init__(self, layer: int, x: torch.Tensor) -> None:
        self.layer, self.shape, self.dtype, self.device = layer, tuple(x.shape), x.dtype, x.device
        self.host: torch.Tensor | None = None
        self.kept: torch.Tensor | None = None
        self.fetched: torch.Tensor | None = None
        self.event = None


class _SwapEntry:
    """One storage a swapped block saved for its backward: its bytes in ``host`` between the block's
    forward and its backward; ``fetched`` (a uint8 device tensor over the bytes) once its copy back
    is started, ``event`` (CUDA: that copy's completion, until the compute stream waited on it).
    Held by every :class:`_SwapRef` of the storage (autograd holds those) and by the block's record
    until its backward starts, so it, the host bytes and the device copy go when autograd is done
    with the last tensor of the storage."""

    __slots__ = ("nbytes", "device", "host", "fetched", "event", "__weakref__")

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes, self.device = int(nbytes), device
        self.host: torch.Tensor | None = None
        self.fetched: torch.Tensor | None = None
        self.event = None


class _SwapRef:
    """What the pack hook returns for a tensor a swapped block saved: its storage's entry and the
    view (dtype, size, stride, offset) to rebuild on the device copy of that storage."""

    __slots__ = ("layer", "entry", "dtype", "size", "stride", "offset")

    def __init__(self, layer: int, entry: _SwapEntry, t: torch.Tensor) -> None:
        self.layer, self.entry = layer, entry
        self.dtype, self.size, self.stride, self.offset = t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset()


class _Swapped:
    """A swapped block's entries between its forward and the start of its backward (the prefetch
    one block ahead finds them here)."""

    __slots__ = ("layer", "entries")

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.entries: list[_SwapEntry] = []


# views and casts between a parameter and what an op saves of it (a weight's transpose, autocast's
# bf16 copy): such a tensor is the parameter's, not an activation, and stays where it is
_THROUGH = frozenset({"TBackward0", "ToCopyBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
                      "ExpandBackward0", "UnsafeViewBackward0", "AliasBackward0", "AsStridedBackward0"})


def _of_a_leaf(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view or cast of a leaf that requires grad (a parameter) in a few steps."""
    fn = t.grad_fn
    for _ in range(4):
        if fn is None:
            return False
        if type(fn).__name__ == "AccumulateGrad" or fn.name().endswith("AccumulateGrad"):
            return True
        if fn.name() not in _THROUGH:
            return False
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return False


def _bytes_of(st, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the whole of untyped storage ``st`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(st)


class OffloadPass:
    """One forward and backward's offload of block inputs and tiling of the MLP, on the rows of
    ``segments`` (``(start, stop, offload)``, covering the pass's rows; ``offload`` True for the rows
    of ``"inputs"`` groups), and its swapped blocks ``swap`` (block indices, all rows: a block runs
    swapped or checkpointed for the whole packed input). ``layers``: the model's blocks (the last
    one's input, or if it is swapped its activations, stay on the device); ``tile``: the MLP's tile
    in tokens (``workbench.cost.offload.mlp_tile_tokens``).

    Use with :func:`offloading` around the forward and backward, passing :attr:`mlp` to the model
    as ``mlp_fn``. After it: :attr:`wait_ms`, the time the compute stream waited for copies back
    (CUDA; 0 on CPU, where the copies are synchronous), :attr:`peak_host_bytes`, the host memory the
    offloaded inputs took at most, and :attr:`swap_host_bytes`, the host memory the swapped blocks'
    activations took (all of them are there when the forward ends). Raises ValueError for a tile
    below 1 or a swapped block outside ``0 .. layers - 1``."""

    def __init__(self, segments: Sequence[tuple[int, int, bool]], *, layers: int, tile: int,
                 swap: Sequence[int] = ()) -> None:
        self.segments = _merge(segments)
        self.layers = int(layers)
        self.mlp = RowMLP(self.segments, tile)
        """The model's ``mlp_fn`` for this pass (swapped blocks do not use it: their MLP runs plain)."""
        self.off = [(lo, hi) for lo, hi, on in self.segments if on]
        self.keep = [(lo, hi) for lo, hi, on in self.segments if not on]
        self.rows = self.segments[-1][1] if self.segments else 0
        bad = [i for i in swap if not 0 <= int(i) < self.layers]
        if bad:
            raise ValueError(f"OffloadPass: swapped block {bad[0]} is outside the model's {self.layers} blocks")
        self.swap = frozenset(int(i) for i in swap)
        """The blocks this pass swaps (``workbench.cost.offload.swap_blocks``)."""
        self.wait_ms = 0.0
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.swap_host_bytes = 0
        self._parked: dict[int, _Parked | _Kept | _Swapped] = {}
        self._waits: list = []  # CUDA: (event before, event after) each wait of the compute stream
        self._streams: dict = {}  # CUDA: the side stream of the copies per device (``offloading`` lends the model's)

    @property
    def active(self) -> bool:
        """Whether any row is offloaded (and tiled) or any block swapped."""
        return bool(self.off) or bool(self.swap)

    def swaps(self, layer: int) -> bool:
        """Whether block ``layer`` runs swapped in this pass."""
        return layer in self.swap

    # the hooks around one block's checkpointed call
    @contextlib.contextmanager
    def block_inputs(self, layer: int, x: torch.Tensor) -> Iterator[None]:
        """The pack/unpack hooks for block ``layer`` whose input is ``x``: inside, what the
        checkpoint saves of ``x`` goes to host memory (unless ``layer`` is the last). With swapped
        blocks in the pass the hooks also mark where the block's backward starts (its input's
        unpack), so that a swapped block before it is fetched one block ahead."""
        park = bool(self.off) and x.shape[0] == self.rows
        if not park and not self.swap:
            yield  # nothing of this pass's rows (or not the rows it was built for: left alone)
            return

        # the hooks outlive the call (autograd keeps them with what they saved), so they must not hold
        # x itself: that would keep every block's input on the device, the very thing moved away
        target = [x]

        def pack(t: torch.Tensor):
            x = target[0] if target else None
            if x is not None and (t is x or (t.data_ptr() == x.data_ptr() and t.shape == x.shape
                                             and t.dtype == x.dtype)):
                target.clear()  # one input per block call
                return self._pack(layer, t) if park else _Kept(layer, t)
            return t  # rotary tables, cu_seqlens: shared by every block, small

        del x
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield
        finally:
            target.clear()

    # the hooks around one swapped block's plain call
    @contextlib.contextmanager
    def swapped_block(self, layer: int, block: nn.Module, shared: Sequence = ()) -> Iterator[None]:
        """The pack/unpack hooks for swapped block ``layer`` (the module ``block``, run plainly
        inside, without checkpoint): every activation its backward needs goes to host memory as the
        block's forward ends, one copy per storage (views of one storage share it), and comes back
        one block ahead in the backward, so nothing of it is recomputed. Left where they are: the
        block's parameters (under FSDP2 the all-gathered ones the unit holds during its forward,
        which FSDP frees and gathers again itself) and views or casts of them, the ``shared``
        tensors (the rotary tables and ``cu_seqlens`` every block gets), and tensors that are not
        floating point (indices, ``cu_seqlens`` copies: small, or shared across blocks). The last
        block keeps everything: its backward comes first."""
        skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
        skip |= {t.untyped_storage().data_ptr() for t in shared if isinstance(t, torch.Tensor)}
        skip.discard(0)
        last = layer == self.layers - 1
        # autograd keeps the pack hook with every tensor it saved (until the node that saved it has
        # run), so what the hook reaches must be emptied when the forward ends: the block's record
        # (else every entry, and its device copy in the backward, lives until the block's last
        # saved tensor is released) and ``held``: storage -> (entry, a tensor of it), kept until the
        # block's forward ends so that no storage is freed and its address reused by another while
        # views are matched to entries (the device keeps them that long without swap as well), then
        # copied to host memory, when their values are final
        rec = [_Swapped(layer)]
        held: dict[int, tuple[_SwapEntry, torch.Tensor]] = {}

        def pack(t: torch.Tensor):
            if not t.is_floating_point() or not rec:
                return t
            st = t.untyped_storage()
            key = st.data_ptr()
            if not key or key in skip or _of_a_leaf(t):
                return t
            if last:
                return _Kept(layer, t)
            hit = held.get(key)
            if hit is None:
                hit = held[key] = (_SwapEntry(st.nbytes(), t.device), t)
                rec[0].entries.append(hit[0])
            return _SwapRef(layer, hit[0], t)

        done = False
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield
            done = True
        finally:
            if done:
                self._swap_out(held)
                if rec[0].entries:
                    self._parked[layer] = rec[0]
            held.clear()
            rec.clear()

    def _swap_out(self, held: dict) -> None:
        """Copy the held storages to host memory (CUDA: pinned, on the side stream after what the
        compute stream has done so far; their device memory is not reused before the copy read it)."""
        waited: set = set()
        with _disable_current_modes():  # host buffers are not device memory: made where LiveBytes does not count
            for entry, t in held.values():
                dev = entry.device
                cuda = dev.type == "cuda"
                entry.host = torch.empty(entry.nbytes, dtype=torch.uint8, device="cpu", pin_memory=cuda)
                src = _bytes_of(t.untyped_storage(), dev)  # (nbytes,) uint8 over the storage
                if cuda:
                    stream = self._copy_stream(dev)
                    if dev not in waited:
                        stream.wait_stream(torch.cuda.current_stream(dev))  # the block's compute is done
                        waited.add(dev)
                    with torch.cuda.stream(stream):
                        entry.host.copy_(src, non_blocking=True)
                    src.record_stream(stream)
                else:
                    entry.host.copy_(src)
                self.swap_host_bytes += entry.nbytes

    def _fetch_swap(self, e: _SwapEntry) -> None:
        """Start the copy back of one swapped storage (CUDA: on the side stream; CPU: done at once)."""
        if e.fetched is not None or e.host is None:
            return
        if e.device.type == "cuda":
            stream = self._copy_stream(e.device)
            with torch.cuda.stream(stream):
                dev = torch.empty(e.nbytes, dtype=torch.uint8, device=e.device)
                dev.copy_(e.host, non_blocking=True)
            e.event = torch.cuda.Event()
            e.event.record(stream)
        else:
            dev = torch.empty(e.nbytes, dtype=torch.uint8, device=e.device)  # counted: device memory again
            with _disable_current_modes():
                dev.copy_(e.host)
        e.fetched = dev

    def _unswap(self, ref: _SwapRef) -> torch.Tensor:
        if self._parked.pop(ref.layer, None) is not None:
            self._prefetch(ref.layer - 1)  # the block's backward starts: the one before it is copied meanwhile
        e = ref.entry
        self._fetch_swap(e)  # (normally started one block ahead)
        dev = e.fetched
        if e.event is not None:  # CUDA, the storage's first use: the compute stream waits for its copy
            cur = torch.cuda.current_stream(e.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(cur)
            cur.wait_event(e.event)
            after.record(cur)
            self._waits.append((before, after))
            dev.record_stream(cur)  # made on the side stream, used and freed on this one
            e.event = None
        # the saved view on the device copy of its storage (kept by the entry while autograd holds a
        # view of it: views of one storage share one copy, as they shared the storage)
        return torch.empty(0, dtype=ref.dtype, device=e.device).set_(dev.untyped_storage(), ref.offset, ref.size,
                                                                      ref.stride)

    def _pack(self, layer: int, x: torch.Tensor):
        if layer == self.layers - 1:
            kept = _Kept(layer, x)
            self._parked[layer] = kept
            return kept
        p = _Parked(layer, x)
        xd = x.detach()
        n = sum(hi - lo for lo, hi in self.off)
        cuda = x.device.type == "cuda"
        # host buffers are not device memory: made (and filled) where LiveBytes does not count
        with _disable_current_modes():
            host = torch.empty((n,) + tuple(x.shape[1:]), dtype=x.dtype, device="cpu", pin_memory=cuda)
            if cuda:
                stream = self._copy_stream(x.device)
                stream.wait_stream(torch.cuda.current_stream(x.device))  # x is computed
                with torch.cuda.stream(stream):
                    self._copy_rows_out(host, xd, non_blocking=True)
                # the allocator must not hand x's memory to the compute stream before the copy read it
                x.record_stream(stream)
            else:
                self._copy_rows_out(host, xd, non_blocking=False)
        p.host = host
        if self.keep:  # device memory, counted: the rows of groups that do not offload
            p.kept = torch.cat([xd[lo:hi] for lo, hi in self.keep])
        self.host_bytes += host.untyped_storage().nbytes()
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        self._parked[layer] = p
        return p

    def _copy_rows_out(self, host: torch.Tensor, xd: torch.Tensor, *, non_blocking: bool) -> None:
        o = 0
        for lo, hi in self.off:
            host[o:o + hi - lo].copy_(xd[lo:hi], non_blocking=non_blocking)
            o += hi - lo

    def _fetch(self, p: _Parked) -> None:
        """Start the copy back of ``p`` (CUDA: on the side stream; CPU: done at once)."""
        if p.fetched is not None or p.host is None:
            return
        if p.device.type == "cuda":
            stream = self._copy_stream(p.device)
            with torch.cuda.stream(stream):
                dev = torch.empty(p.shape, dtype=p.dtype, device=p.device)  # (T, C)
                self._copy_rows_in(dev, p.host, non_blocking=True)
            p.event = torch.cuda.Event()
            p.event.record(stream)
        else:
            dev = torch.empty(p.shape, dtype=p.dtype, device=p.device)  # counted: device memory again
            self._copy_rows_in(dev, p.host, non_blocking=False)
        p.fetched = dev

    def _copy_rows_in(self, dev: torch.Tensor, host: torch.Tensor, *, non_blocking: bool) -> None:
        with _disable_current_modes():  # views of the host buffer: not device memory, not counted
            parts, o = [], 0
            for lo, hi in self.off:
                parts.append(host[o:o + hi - lo])
                o += hi - lo
        for (lo, hi), part in zip(self.off, parts):
            dev[lo:hi].copy_(part, non_blocking=non_blocking)

    def _unpack(self, obj):
        if isinstance(obj, _SwapRef):
            return self._unswap(obj)
        if isinstance(obj, _Kept):
            self._parked.pop(obj.layer, None)  # the checkpoint holds it until the block's backward ends
            self._prefetch(obj.layer - 1)
            return obj.tensor
        if not isinstance(obj, _Parked):
            return obj
        self._fetch(obj)  # (normally started one layer ahead)
        self._prefetch(obj.layer - 1)  # the next block backward needs, copied while this one runs
        dev = obj.fetched
        if obj.device.type == "cuda":
            cur = torch.cuda.current_stream(obj.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(cur)
            cur.wait_event(obj.event)
            after.record(cur)
            self._waits.append((before, after))
            dev.record_stream(cur)  # made on the side stream, used and freed on this one
        if obj.kept is not None:
            for (lo, hi), part in zip(self.keep, obj.kept.split([hi - lo for lo, hi in self.keep])):
                dev[lo:hi].copy_(part)
        # the device tensor now belongs to the recomputation; the host copy stays until the pass ends
        # (a second unpack, as a retained graph would make, copies it back again)
        obj.fetched, obj.event, obj.kept = None, None, None
        return dev

    def _prefetch(self, layer: int) -> None:
        p = self._parked.get(layer)
        if isinstance(p, _Parked):
            self._fetch(p)
        elif isinstance(p, _Swapped):
            for e in p.entries:
                self._fetch_swap(e)

    def _copy_stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def finish(self) -> None:
        """End of the pass: the waits summed into :attr:`wait_ms` (synchronising their events) and
        every host buffer released."""
        if self._waits:
            for before, after in self._waits:
                after.synchronize()
                self.wait_ms += before.elapsed_time(after)
            self._waits.clear()
        self._parked.clear()
        self.host_bytes = 0


class _Slot:
    """The model's place for the active pass (one per model, made by :func:`apply_offload`), and
    its CUDA side streams, kept across passes."""

    def __init__(self) -> None:
        self.active: OffloadPass | None = None
        self.streams: dict = {}


def apply_offload(model: nn.Module) -> None:
    """Make every block of ``model.blocks`` run its checkpointed forward inside the hooks of the
    :class:`OffloadPass` active on the model (:func:`offloading`), or, when the pass swaps the
    block, its plain forward (no checkpoint, the plain MLP) inside the pass's swap hooks; and the
    checkpointed forward plainly when no pass is active. Apply after ``apply_recompute`` (the hooks
    go around the checkpoint) and before ``fully_shard``, as ``zero.parallelize`` does. Idempotent.
    Raises ValueError when a block does not recompute: offloaded inputs are the checkpointed ones,
    and a swapped block is one that is not recomputed."""
    if getattr(model, "_workbench_offload", None) is not None:
        return
    if not all(getattr(b, "_workbench_recompute", False) for b in model.blocks):
        raise ValueError("offloading block inputs needs recomputation: apply_recompute first (--recompute)")
    slot = _Slot()
    for i, block in enumerate(model.blocks):
        inner = block.forward  # the checkpointing forward
        plain = type(block).forward.__get__(block)  # the block's own forward: neither checkpointed nor wrapped

        def forward(x, cos, sin, cu_seqlens, max_seqlen, attn, mlp_fn=None, *, _inner=inner, _plain=plain, _layer=i,
                    _block=block):
            op = slot.active
            if op is None:
                return _inner(x, cos, sin, cu_seqlens, max_seqlen, attn, mlp_fn)
            if op.swaps(_layer):
                # a swapped block is not recomputed, so a tiled MLP (which recomputes its tiles) buys
                # nothing: its MLP runs plain whatever the rows' offload level
                with op.swapped_block(_layer, _block, (cos, sin, cu_seqlens)):
                    return _plain(x, cos, sin, cu_seqlens, max_seqlen, attn, None)
            with op.block_inputs(_layer, x):
                return _inner(x, cos, sin, cu_seqlens, max_seqlen, attn, mlp_fn)

        block.forward = forward  # an instance attribute, as apply_recompute's: names and state dicts unchanged
    model._workbench_offload = slot


@contextlib.contextmanager
def offloading(model: nn.Module, op: OffloadPass) -> Iterator[OffloadPass]:
    """``op`` active on ``model`` for what runs inside (one forward and its backward): its blocks'
    inputs offloaded, its swapped blocks swapped. On exit ``op.finish()``. Raises ValueError when ``model`` has no
    :func:`apply_offload` and ``op`` offloads something, or another pass is already active."""
    slot = getattr(model, "_workbench_offload", None)
    if slot is None:
        if op.active:
            raise ValueError("this model does not offload block inputs or swap blocks: it runs without "
                             "recomputation (zero.parallelize(recompute=True) applies offloading)")
        yield op
        return
    if slot.active is not None:
        raise ValueError("an offload pass is already active on this model")
    op._streams = slot.streams  # one side stream per device for the model's life, made at its first copy
    slot.active = op
    try:
        yield op
    finally:
        slot.active = None
        op.finish()


def offload_pass(segments: Sequence[tuple[int, int, bool]], model: nn.Module, *,
                 swap_layers: int = 0) -> OffloadPass | None:
    """The :class:`OffloadPass` of a forward over rows ``segments`` (``(start, stop, offload)``) of
    ``model`` (its ``spec`` gives the layers and the MLP's tile, ``workbench.cost.offload``) that
    swaps ``swap_layers`` of its blocks (``swap_blocks``), or None when no row offloads and no block
    is swapped. Raises ValueError for ``swap_layers`` outside ``0 .. layers``."""
    layers = len(model.blocks)
    swap = swap_blocks(layers, swap_layers)
    if not any(on for _, _, on in segments) and not swap:
        return None
    return OffloadPass(segments, layers=layers, tile=mlp_tile_tokens(model.spec), swap=swap)
