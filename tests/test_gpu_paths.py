"""Every GPU-only branch, driven on CPU with stand-ins that check what the real call requires.

- flash-attn: ``tests/fakes`` holds stand-ins for flash-attn 2.x (``flash_attn``) and 3.x
  (``flash_attn_interface``) that refuse what the real varlen kernel refuses (read from flash-attn
  2.8's ``mha_varlen_fwd`` and the 3.x Hopper interface) and compute with PyTorch's SDPA in the
  input dtype. The workbench's flash callable, the model and the backend choice run through them.
- torch's ``varlen_attn``: ``tests/fakes/_varlen_checks.py`` replaces the two CUDA ops it calls
  (``aten::_flash_attention_forward``/``_backward``) with functions that refuse what the vendored
  ``mha_varlen_fwd``/``bwd`` refuse and compute dense attention; ``varlen_attn`` itself (its checks,
  custom op and autograd) runs for real. Calls whose queries are shorter than their keys (context
  parallelism's) are checked against the PyTorch path, forward and backward.
- CUDA events and the allocator's peak: a stand-in ``torch.cuda`` whose kernels run asynchronously
  on a fake GPU clock and whose allocator keeps a high-water mark, so timing that forgets to
  synchronise, uses the host clock, or does not reset the peak per step gets a wrong number.
- device selection: ``LOCAL_RANK`` -> ``cuda:LOCAL_RANK``, ``set_device`` before the process group,
  NCCL bound to that device.
- NCCL's rules: every rank creates every subgroup in the same order (a stand-in ``new_group``
  records each rank's calls). The collectives a real run makes are audited in
  ``tests/test_gpu_dist.py`` (2 gloo ranks).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

import pytest
import torch

from workbench.runtime.attention import (CAUSAL_WINDOW, AttentionUnavailable, flash_attention_fn, varlen_attention_fn,
                                         flash_call_problem, flash_version, select_attention, torch_varlen_attention,
                                         varlen_call_problem, varlen_version)

FAKES = Path(__file__).resolve().parent / "fakes"


# ------------------------------------------------------------------------------------------------
# flash-attn stand-ins
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _stand_in_modules():
    """The stand-ins imported inside leave ``sys.modules`` as they found it (other tests in this
    worker check that flash-attn is imported lazily)."""
    names = ("flash_attn", "flash_attn_interface", "_flash_checks")
    saved = {m: sys.modules.pop(m) for m in names if m in sys.modules}
    try:
        yield
    finally:
        for m in names:
            sys.modules.pop(m, None)
        sys.modules.update(saved)


@pytest.fixture
def fake_fa2(monkeypatch):
    """flash-attn 2.x's stand-in importable as ``flash_attn`` (and no 3.x)."""
    monkeypatch.syspath_prepend(str(FAKES))
    with _stand_in_modules():
        monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # 3.x absent
        fa = importlib.import_module("flash_attn")
        fa.CALLS.clear()
        yield fa


@pytest.fixture
def fake_fa3(monkeypatch):
    """Only flash-attn 3.x's stand-in (``flash_attn_interface``); no ``flash_attn``."""
    monkeypatch.syspath_prepend(str(FAKES / "fa3"))
    monkeypatch.syspath_prepend(str(FAKES))
    with _stand_in_modules():
        monkeypatch.setitem(sys.modules, "flash_attn", None)  # 2.x absent
        fa = importlib.import_module("flash_attn_interface")
        fa.CALLS.clear()
        yield fa


@pytest.fixture
def no_flash(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)


@pytest.fixture
def no_varlen(monkeypatch):
    """torch without its varlen kernel (as a CPU build, or torch < 2.10), whatever this machine has."""
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)


def _qkv(T=23, H=4, KV=2, hd=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, h, hd, generator=g).to(dtype) for h in (H, KV, KV))


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_the_stand_in_refuses_what_the_kernel_refuses(fake_fa2):
    q, k, v = _qkv()
    cu = _cu([10, 13])
    f = fake_fa2.flash_attn_varlen_func
    assert f(q, k, v, cu, cu, 13, 13, causal=True).shape == q.shape
    bad = [
        ((q.float(), k.float(), v.float(), cu, cu, 13, 13), "fp16 and bf16"),
        ((q, k.half(), v, cu, cu, 13, 13), "same dtype"),
        ((q, k, v, cu.long(), cu, 13, 13), "int32"),
        ((q, k, v, cu, cu, torch.tensor(13), 13), "must be int"),
        ((q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cu, cu, 13, 13), "contiguous"),
        ((q, k[:, :1].repeat(1, 3, 1), v[:, :1].repeat(1, 3, 1), cu, cu, 13, 13), "divide"),
        ((q, k, v, cu, cu, 12, 12), "longer than max_seqlen"),
    ]
    for args, words in bad:
        with pytest.raises((RuntimeError, TypeError), match=words):
            f(*args, causal=True)
    # the workbench's own pre-check names the same problems before the kernel would
    assert "fp16/bf16" in flash_call_problem(q.float(), k.float(), v.float(), cu, cu, 13, 13)
    assert "int32" in flash_call_problem(q, k, v, cu.long(), cu, 13, 13)
    assert "int32" in flash_call_problem(q, k, v, cu, cu.long(), 13, 13)
    assert "Python int" in flash_call_problem(q, k, v, cu, cu, torch.tensor(13), 13)
    assert "one length" in flash_call_problem(q, k, v, cu, _cu([23]), 13, 23)
    assert flash_call_problem(q, k, v, cu, cu, 13, 13) is None


@pytest.mark.parametrize("lengths, H, KV", [([23], 4, 4), ([5, 1, 17], 4, 2), ([8, 8, 8], 4, 1)])
def test_flash_callable_matches_the_pytorch_path(fake_fa2, lengths, H, KV):
    T = sum(lengths)
    q, k, v = _qkv(T, H, KV, 16, torch.bfloat16, seed=len(lengths))
    cu = _cu(lengths)
    fn = flash_attention_fn("bf16")
    # the callable receives what the model hands it: int64 boundaries are converted, the max length
    # may be a numpy or tensor scalar
    mx = torch.tensor(max(lengths))
    out = fn(q, k, v, cu.long(), cu.long(), mx, mx)
    ref = torch_varlen_attention(q.float(), k.float(), v.float(), cu, cu, max(lengths), max(lengths))
    assert out.dtype == torch.bfloat16 and out.shape == (T, H, 16)
    assert float((out.float() - ref).abs().max()) < 2e-2  # bf16 inputs: a few units of 2^-8
    call = fake_fa2.CALLS[-1]
    assert call["causal"] is True and call["cu"] == cu.tolist() and call["max_seqlen"] == (max(lengths),) * 2
    assert call["kv_heads"] == KV  # grouped-query attention goes to the kernel as it is


def test_an_fp32_run_never_gets_flash_silently(fake_fa2):
    q, k, v = _qkv(dtype=torch.float32)
    cu = _cu([23])
    with pytest.raises(ValueError, match="fp16/bf16 only"):
        flash_attention_fn("bf16")(q, k, v, cu, cu, 23, 23)
    assert fake_fa2.CALLS == []  # refused before the kernel
    # the backend choice: auto on CUDA with fp32 takes the PyTorch path, flash is refused in one line
    fn, name = select_attention("auto", "cuda", "fp32")
    assert name == "torch" and fn is torch_varlen_attention
    with pytest.raises(AttentionUnavailable, match="precision is fp32; use --precision bf16"):
        select_attention("flash", "cuda", "fp32")
    # without a declared precision (the profiler measuring an fp32 model) fp32 runs in bf16 and comes back fp32
    out = flash_attention_fn(None)(q, k, v, cu, cu, 23, 23)
    assert out.dtype == torch.float32 and fake_fa2.CALLS[-1]["dtype"] == torch.bfloat16


def test_backend_choice_with_and_without_flash(fake_fa2, no_varlen, monkeypatch):
    fn, name = select_attention("auto", "cuda", "bf16")
    assert name == "flash" and fn is not torch_varlen_attention
    assert flash_version() == "flash_attn 2.8.3+fake"
    fn, name = select_attention("flash", "cuda:1", "bf16")
    assert name == "flash"
    with pytest.raises(AttentionUnavailable, match="needs a CUDA device"):
        select_attention("flash", "cpu", "bf16")


def test_without_flash_auto_falls_back_and_flash_is_refused(no_flash, no_varlen):
    assert flash_version() is None
    fn, name = select_attention("auto", "cuda", "bf16")
    assert name == "torch"
    with pytest.raises(AttentionUnavailable, match="needs flash-attn.*use --attention varlen or torch"):
        select_attention("flash", "cuda", "bf16")


def test_flash_3_interface_is_used_when_2_is_absent(fake_fa3):
    q, k, v = _qkv(T=12, H=4, KV=2)
    cu = _cu([7, 5])
    assert flash_version() == "flash_attn_interface 3.0.0b1+fake"
    out = flash_attention_fn("bf16")(q, k, v, cu, cu, 7, 7)  # 3.x: no dropout_p, returns (out, lse)
    ref = torch_varlen_attention(q.float(), k.float(), v.float(), cu, cu, 7, 7)
    assert isinstance(out, torch.Tensor) and float((out.float() - ref).abs().max()) < 2e-2


def test_model_forward_and_backward_through_flash_under_bf16_autocast(fake_fa2):
    """The whole model in the precision a bf16 run declares (autocast over fp32 weights, as ZeRO 0-2
    runs it): every layer's attention call reaches the stand-in in bf16 and the loss and gradients
    agree with the PyTorch path's in the same precision."""
    layers = _bf16_model_agrees_with_the_torch_path(flash_attention_fn("bf16"))
    assert len(fake_fa2.CALLS) == layers and {c["dtype"] for c in fake_fa2.CALLS} == {torch.bfloat16}


def _bf16_model_agrees_with_the_torch_path(attn) -> int:
    """The tiny model's loss and gradients on three sequences under bf16 autocast with ``attn``
    against the PyTorch attention path's (within bf16 tolerance); returns its layer count."""
    from workbench.models import get_model
    from workbench.runtime.model import Transformer
    from workbench.runtime.step import batch_loss

    spec = get_model("tiny")
    seqs = [torch.randint(0, spec.vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in (40, 9, 77)]
    losses, grads = {}, {}
    for name, fn in (("kernel", attn), ("torch", torch_varlen_attention)):
        model = Transformer(spec, seed=3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = batch_loss(model, seqs, fn)
        loss.backward()
        losses[name] = float(loss.detach())
        grads[name] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert losses["kernel"] == pytest.approx(losses["torch"], rel=1e-2)
    rel = float((grads["kernel"] - grads["torch"]).norm() / grads["torch"].norm())
    assert rel < 2e-2, rel
    return spec.layers


def test_pass_attention_hands_each_group_its_own_boundaries(fake_fa2):
    """A lockstep pass packs several groups' tokens; each group's flash call gets its own int32
    boundaries on the tensors' device and its own max length."""
    from workbench.runtime.step import PassAttention

    fn = flash_attention_fn("bf16")
    q, k, v = _qkv(T=30, H=4, KV=2)
    segs = [(0, 12, fn, _cu([5, 7]), 7), (12, 30, fn, _cu([18]), 18)]
    out = PassAttention(segs)(q, k, v, _cu([30]), _cu([30]), 30, 30)
    ref = torch.cat([torch_varlen_attention(q[a:b].float(), k[a:b].float(), v[a:b].float(), cu, cu, m, m)
                     for a, b, _, cu, m in segs])
    assert float((out.float() - ref).abs().max()) < 2e-2
    assert [c["cu"] for c in fake_fa2.CALLS] == [[0, 5, 12], [0, 18]]
    assert [c["max_seqlen"] for c in fake_fa2.CALLS] == [(7, 7), (18, 18)]


@pytest.mark.parametrize("lens_q, lens_k", [([3, 8, 1], [10, 8, 5]), ([4, 4], [4, 16])])
def test_flash_callable_with_queries_shorter_than_keys(fake_fa2, lens_q, lens_k):
    """Context parallelism's call: each query segment the last rows of its key segment (bottom-right)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lens_q), 4, 16, generator=g).bfloat16()
    k, v = (torch.randn(sum(lens_k), 2, 16, generator=g).bfloat16() for _ in range(2))
    out = flash_attention_fn("bf16")(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k))
    ref = torch_varlen_attention(q.float(), k.float(), v.float(), _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k))
    assert float((out.float() - ref).abs().max()) < 2e-2
    call = fake_fa2.CALLS[-1]
    assert call["cu"] == _cu(lens_q).tolist() and call["cu_k"] == _cu(lens_k).tolist()
    assert call["max_seqlen"] == (max(lens_q), max(lens_k)) and call["causal"] is True


# ------------------------------------------------------------------------------------------------
# torch's varlen_attn stand-in
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_varlen(monkeypatch):
    """torch's ``varlen_attn`` with its two CUDA ops replaced by the stand-ins (tests/fakes/_varlen_checks.py)."""
    monkeypatch.syspath_prepend(str(FAKES))
    import _varlen_checks

    _varlen_checks.CALLS.clear()
    with _varlen_checks.installed() as calls:
        yield calls


def _grads(out, g, inputs):
    return torch.autograd.grad((out.float() * g.float()).sum(), inputs)


def test_the_varlen_stand_in_refuses_what_the_kernel_refuses(fake_varlen):
    """The ops refuse what ``mha_varlen_fwd`` refuses; ``varlen_attn`` refuses grouped-query
    attention without ``enable_gqa`` by itself; the workbench's pre-check names the same problems,
    and the one ``varlen_attn`` would not raise for: a window that is not the causal tuple."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = _qkv(T=12, H=4, KV=2)
    cu = _cu([5, 7])
    assert varlen_attn(q, k, v, cu, cu, 7, 7, window_size=CAUSAL_WINDOW, enable_gqa=True).shape == q.shape
    bad = [
        (dict(query=q.float(), key=k.float(), value=v.float()), "fp16 and bf16"),
        (dict(cu_seq_q=cu.long()), "int32"),
        (dict(max_q=4), "longer than max_seqlen"),
        (dict(cu_seq_k=_cu([12])), r"shape \(batch_size \+ 1\)"),
        (dict(query=torch.zeros(12, 4, 12).bfloat16(), key=torch.zeros(12, 2, 12).bfloat16(),
              value=torch.zeros(12, 2, 12).bfloat16()), "multiple of 8"),
    ]
    for change, words in bad:
        args = dict(query=q, key=k, value=v, cu_seq_q=cu, cu_seq_k=cu, max_q=7, max_k=7)
        args.update(change)
        with pytest.raises((RuntimeError, TypeError), match=words):
            varlen_attn(**args, window_size=CAUSAL_WINDOW, enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        varlen_attn(q, k, v, cu, cu, 7, 7, window_size=CAUSAL_WINDOW)
    ok = dict(enable_gqa=True, window_size=CAUSAL_WINDOW)
    assert varlen_call_problem(q, k, v, cu, cu, 7, 7, **ok) is None
    assert "enable_gqa" in varlen_call_problem(q, k, v, cu, cu, 7, 7, enable_gqa=False, window_size=CAUSAL_WINDOW)
    assert "(a tuple)" in varlen_call_problem(q, k, v, cu, cu, 7, 7, enable_gqa=True, window_size=[-1, 0])
    assert "(a tuple)" in varlen_call_problem(q, k, v, cu, cu, 7, 7, enable_gqa=True, window_size=(-1, -1))
    assert "fp16/bf16" in varlen_call_problem(q.float(), k.float(), v.float(), cu, cu, 7, 7, **ok)
    assert "Python int" in varlen_call_problem(q, k, v, cu, cu, 7, torch.tensor(7), **ok)


@pytest.mark.parametrize("lens_q, lens_k, H, KV", [([23], [23], 4, 4), ([5, 1, 17], [5, 1, 17], 4, 2),
                                                    ([3, 8, 1], [10, 8, 5], 4, 1), ([2, 2], [2, 9], 2, 2)])
def test_varlen_callable_matches_the_pytorch_path(fake_varlen, lens_q, lens_k, H, KV):
    """Forward and backward through the real ``varlen_attn`` (its custom op and autograd) against
    the PyTorch path on the same bf16 values, self-attention and queries shorter than keys."""
    g = torch.Generator().manual_seed(len(lens_q) + H + KV)
    q = torch.randn(sum(lens_q), H, 16, generator=g).bfloat16().requires_grad_(True)
    k, v = (torch.randn(sum(lens_k), KV, 16, generator=g).bfloat16().requires_grad_(True) for _ in range(2))
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    # what the model hands a kernel: int64 boundaries are converted, the max lengths may be tensors
    out = varlen_attention_fn("bf16")(q, k, v, cu_q.long(), cu_k.long(), torch.tensor(max(lens_q)), max(lens_k))
    qr, kr, vr = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = torch_varlen_attention(qr, kr, vr, cu_q, cu_k, max(lens_q), max(lens_k))
    assert out.dtype == torch.bfloat16 and float((out.detach().float() - ref.detach()).abs().max()) < 2e-2
    gout = torch.randn(out.shape, generator=g)
    for a, b in zip(_grads(out, gout, (q, k, v)), _grads(ref, gout, (qr, kr, vr))):
        assert a.dtype == torch.bfloat16 and float((a.float() - b).abs().max()) < 3e-2
    fwd, bwd = fake_varlen[-2:]
    assert (fwd["op"], bwd["op"]) == ("forward", "backward")
    assert fwd["is_causal"] and fwd["window"] == (-1, 0) and fwd["kv_heads"] == KV
    assert (fwd["cu_q"], fwd["cu_k"], fwd["max"]) == (cu_q.tolist(), cu_k.tolist(), (max(lens_q), max(lens_k)))


def test_varlen_backend_choice(fake_varlen, fake_fa2):
    """auto on CUDA in half precision takes torch's varlen kernel before flash-attn (chosen per call
    against SDPA per sequence: tests/test_attention_choice.py); fp32 and CPU never get it; asked for
    by name where it cannot run it is refused in one line."""
    assert varlen_version() == f"torch {torch.__version__}"
    fn, name = select_attention("auto", "cuda", "bf16")
    assert name == "varlen+sdpa" and fn is not torch_varlen_attention
    assert select_attention("varlen", "cuda:1", "bf16")[1] == "varlen"
    assert select_attention("auto", "cuda", "fp32")[1] == "torch"
    assert select_attention("auto", "cpu", "bf16")[1] == "torch"
    with pytest.raises(AttentionUnavailable, match="'varlen' computes in fp16/bf16 but this run's precision is fp32"):
        select_attention("varlen", "cuda", "fp32")
    with pytest.raises(AttentionUnavailable, match="'varlen' needs a CUDA device, this run is on cpu"):
        select_attention("varlen", "cpu", "bf16")
    with pytest.raises(ValueError, match="fp16/bf16 only"):  # a declared bf16 run never casts silently
        varlen_attention_fn("bf16")(*_qkv(dtype=torch.float32), _cu([23]), _cu([23]), 23, 23)


def test_varlen_unavailable(no_varlen, fake_fa2, monkeypatch):
    assert varlen_version() is None
    assert select_attention("auto", "cuda", "bf16")[1] == "flash"  # the next in line
    with pytest.raises(AttentionUnavailable, match="lacks; use --attention flash or torch"):
        select_attention("varlen", "cuda", "bf16")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (7, 5))  # a Turing GPU
    with pytest.raises(AttentionUnavailable, match="compute capability 8.0 .* has 7.5; use --attention torch"):
        select_attention("varlen", "cuda", "bf16")
    assert select_attention("auto", "cuda", "bf16")[1] == "torch"


def test_the_doctors_varlen_probe(fake_varlen):
    """The doctor's GPU line compares the varlen kernel with the PyTorch path on a call with GQA and
    queries shorter than keys; on CPU it only says which kernel auto runs."""
    from workbench.runtime import probe as doctor

    err = doctor.varlen_error(torch.device("cpu"), torch.bfloat16)
    assert 0 < err < 5e-2
    (call,) = fake_varlen
    assert call["cu_q"] == [0, 40, 41, 105] and call["cu_k"] == [0, 200, 207, 271] and call["kv_heads"] == 2
    line = doctor._kernel_check(torch.device("cpu"), "fp32")
    assert line["status"] == "ok" and "--attention auto runs torch on cpu in fp32" in line["detail"]


def test_model_forward_and_backward_through_varlen_under_bf16_autocast(fake_varlen):
    """The whole model as a bf16 run computes (autocast over fp32 weights): every layer's call
    reaches torch's varlen_attn in bf16 and the loss and gradients agree with the PyTorch path's."""
    layers = _bf16_model_agrees_with_the_torch_path(varlen_attention_fn("bf16"))
    fwd = [c for c in fake_varlen if c["op"] == "forward"]
    assert len(fwd) == layers and {c["dtype"] for c in fwd} == {torch.bfloat16}
    assert sum(c["op"] == "backward" for c in fake_varlen) == layers


# ------------------------------------------------------------------------------------------------
# CUDA events and the allocator's peak
# ------------------------------------------------------------------------------------------------


class FakeCuda:
    """A stand-in for the parts of ``torch.cuda`` timing and memory use. Work is queued on a stream
    and runs only when the host synchronises (kernels are asynchronous); events are stamped with
    the GPU clock when the queue reaches them, and ``elapsed_time`` refuses an event the GPU has not
    reached or one made without ``enable_timing``. The allocator allocates when work is queued
    (the caching allocator is host-side) and keeps a high-water mark until ``reset_peak_memory_stats``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.queue: list = []
        self.gpu_ms = 0.0
        self.allocated = 0
        self.peak = 0
        self.calls: list[str] = []
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
                self.enable_timing = enable_timing
                self.stamp: float | None = None
                self.recorded = False

            def record(self, stream=None):
                self.recorded = True
                fake.queue.append(("event", self))

            def elapsed_time(self, end) -> float:
                if not (self.enable_timing and end.enable_timing):
                    raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
                if self.stamp is None or end.stamp is None:
                    raise RuntimeError("CUDA error: device not ready")
                return end.stamp - self.stamp

        self.Event = Event

    def _dev(self, device) -> None:
        if torch.device(device) != self.device:
            raise AssertionError(f"called for {device}, this rank's GPU is {self.device}")

    def launch(self, ms: float, alloc: int = 0, free: int = 0) -> None:
        """Queue a kernel of ``ms`` GPU time that allocates ``alloc`` bytes and then frees ``free``."""
        self.allocated += alloc
        self.peak = max(self.peak, self.allocated)
        self.allocated -= free
        self.queue.append(("kernel", ms))

    def synchronize(self, device=None) -> None:
        if device is not None:
            self._dev(device)
        self.calls.append("synchronize")
        for kind, x in self.queue:
            if kind == "kernel":
                self.gpu_ms += x
            else:
                x.stamp = self.gpu_ms
        self.queue.clear()

    def reset_peak_memory_stats(self, device=None) -> None:
        self._dev(device)
        self.calls.append("reset")
        self.peak = self.allocated

    def max_memory_allocated(self, device=None) -> int:
        self._dev(device)
        return self.peak

    def memory_allocated(self, device=None) -> int:
        self._dev(device)
        return self.allocated


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda(torch.device("cuda", 1))
    for name in ("Event", "synchronize", "reset_peak_memory_stats", "max_memory_allocated", "memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def test_clock_times_the_gpu_work_not_the_launches(fake_cuda):
    from workbench.runtime.timing import Clock

    clock = Clock("cuda:1")
    clock.mark()
    fake_cuda.launch(12.5)
    clock.mark()
    fake_cuda.launch(3.0)
    fake_cuda.launch(4.0)
    clock.mark()
    # the host returns at once; only the events on the stream know how long the GPU worked
    assert clock.intervals() == [12.5, 7.0]
    assert fake_cuda.calls == ["synchronize"]  # one synchronisation, after the last mark
    assert clock.intervals() == []  # the marks were consumed
    # a step that failed half-way (an out-of-memory after its first mark) leaves nothing behind a reset
    clock.mark()
    clock.reset()
    clock.mark()
    fake_cuda.launch(2.0)
    clock.mark()
    assert clock.intervals() == [2.0]


def test_step_stats_reset_the_peak_each_step_and_leave_the_first_out(fake_cuda):
    from workbench.runtime.timing import Clock, PeakMemory, StepStats

    fake_cuda.allocated = 1000  # model states live across steps
    clock, mem, stats = Clock("cuda:1"), PeakMemory("cuda:1"), StepStats()
    # step 1: warm-up (slow, a large transient workspace); steps 2-4: the steady state
    work = [(40.0, 9000), (10.0, 3000), (12.0, 4000), (11.0, 3500)]
    for ms, transient in work:
        mem.start()
        clock.mark()
        fake_cuda.launch(ms, alloc=transient, free=transient)
        clock.mark()
        (dt,) = clock.intervals()
        stats.add(dt, mem.peak())
    s = stats.summary()
    assert [p for p in stats.peaks] == [10000, 4000, 5000, 4500]  # each step's own peak, not the high-water mark
    assert s["used"] == 3 and s["median_ms"] == 11.0 and s["peak_bytes"] == 5000
    assert s["first_ms"] == 40.0 and s["first_peak_bytes"] == 10000
    assert mem.base == 1000
    assert fake_cuda.calls.count("reset") == 4


def test_cpu_timing_needs_no_cuda():
    from workbench.runtime.timing import Clock, PeakMemory

    c = Clock("cpu")
    c.mark()
    c.mark()
    (dt,) = c.intervals()
    assert 0 <= dt < 1000
    m = PeakMemory("cpu")
    m.start()
    assert m.peak() is None


# ------------------------------------------------------------------------------------------------
# device selection
# ------------------------------------------------------------------------------------------------


def _fake_gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_local_rank_picks_its_gpu(monkeypatch, local_rank):
    from workbench.runtime.train import DistEnv, resolve_device
    from workbench.scenario import Scenario
    from workbench.training import TrainSpec

    _fake_gpus(monkeypatch, 4)
    env = DistEnv(rank=4 + local_rank, world_size=8, local_rank=local_rank, local_world_size=4)
    for device in ("cuda", "auto"):
        spec = TrainSpec(scenario=Scenario(model="tiny", num_gpus=8, gpus_per_node=4), steps=1, nproc=4, nnodes=2,
                         device=device)
        assert resolve_device(spec, env) == torch.device("cuda", local_rank)


def test_device_errors_are_one_line(monkeypatch):
    from workbench.runtime.train import DistEnv, TrainError, resolve_device
    from workbench.scenario import Scenario
    from workbench.training import TrainSpec

    spec = TrainSpec(scenario=Scenario(model="tiny", num_gpus=4, gpus_per_node=4), steps=1, nproc=4, device="cuda")
    _fake_gpus(monkeypatch, 2)
    with pytest.raises(TrainError, match="local rank 3 has no GPU: this node has 2; lower --nproc to 2"):
        resolve_device(spec, DistEnv(rank=3, world_size=4, local_rank=3, local_world_size=4))
    _fake_gpus(monkeypatch, 0)
    with pytest.raises(TrainError, match="no CUDA device; use --device cpu or auto"):
        resolve_device(spec, DistEnv(rank=0, world_size=4, local_rank=0, local_world_size=4))
    auto = spec.replace(device="auto")
    assert resolve_device(auto, DistEnv(rank=0, world_size=4, local_rank=0, local_world_size=4)).type == "cpu"


def test_set_device_comes_before_the_process_group(monkeypatch, tmp_path, no_flash):
    """A rank with LOCAL_RANK 1 binds cuda:1 before anything else touches CUDA and before
    ``init_process_group``, which gets NCCL and ``device_id=cuda:1``."""
    import torch.distributed as dist

    from workbench import training
    from workbench.runtime import train

    _fake_gpus(monkeypatch, 2)
    monkeypatch.setattr(training, "cuda_visible", lambda: True)
    run, spec, _ = training.prepare_train({"steps": 1, "nproc": 1, "device": "cuda", "max_len": 256,
                                           "batch_tokens": 1024}, root=tmp_path, name="r")
    events = []

    class Stop(Exception):
        pass

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: events.append(("set_device", torch.device(d))))

    def init(backend, **kw):
        events.append(("init_process_group", backend, kw.get("device_id")))
        raise Stop()

    monkeypatch.setattr(dist, "init_process_group", init)
    env = train.DistEnv(rank=0, world_size=1, local_rank=1, local_world_size=1)
    code = train.Trainer(run.path, env).run()
    assert code == 1  # the stand-in process group stops it
    assert events == [("set_device", torch.device("cuda", 1)), ("init_process_group", "nccl", torch.device("cuda", 1))]


# ------------------------------------------------------------------------------------------------
# NCCL's rules
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world, degrees", [(4, (1, 2, 4)), (8, (1, 2, 4, 8)), (16, (2, 8, 16)), (8, (1, 4))])
def test_every_rank_creates_every_subgroup_in_the_same_order(monkeypatch, world, degrees):
    """``new_group`` is collective: NCCL hangs when one rank skips a group or creates them in
    another order. Every rank records the same calls, for every aligned block of every degree
    (also those it is not in)."""
    import torch.distributed as dist

    from workbench.runtime.groups import GroupRegistry, aligned_blocks

    calls: dict[int, list] = {}
    me = {"rank": 0}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: me["rank"])
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend=None, **kw: calls[me["rank"]].append(tuple(ranks))
                        or ("group", tuple(ranks)))
    for r in reversed(range(world)):  # ranks arrive in any order
        me["rank"] = r
        calls[r] = []
        reg = GroupRegistry(world, degrees)
        assert reg.rank == r
    want = [b for d in sorted(degrees) if 1 < d < world for b in aligned_blocks(world, d)]
    assert all(c == want for c in calls.values()), calls


@pytest.mark.parametrize("world, degrees, shapes", [(4, (1, 2, 4), ((2, 2), (4, 2), (4, 4))),
                                                    (8, (1, 8), ((8, 2), (8, 4))),
                                                    (16, (4, 16), ((16, 2), (4, 2), (16, 16)))])
def test_every_rank_creates_the_split_subgroups_in_the_same_order(monkeypatch, world, degrees, shapes):
    """With ``u x c`` splits the registry also makes the Ulysses blocks no degree made and the
    strided CP sub-groups of every block; every rank records the same calls, each group once, and
    ``subgroups`` hands every rank of a split group the groups its collectives use."""
    import torch.distributed as dist

    from workbench.runtime.groups import GroupRegistry, aligned_blocks, split_subgroups

    calls: dict[int, list] = {}
    me = {"rank": 0}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: me["rank"])
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend=None, **kw: calls[me["rank"]].append(tuple(ranks))
                        or ("group", tuple(ranks)))
    regs = {}
    for r in reversed(range(world)):
        me["rank"] = r
        calls[r] = []
        regs[r] = GroupRegistry(world, degrees, shapes=shapes)
    first = calls[0]
    assert all(c == first for c in calls.values()) and len(set(first)) == len(first)
    made = set(first) | {tuple(range(world))}
    for d, c in shapes:
        u = d // c
        for block in aligned_blocks(world, d):
            for k, r in enumerate(block):
                ug, cg = regs[r].subgroups(block, c)
                want_u = tuple(block[0] + (k // u) * u + a for a in range(u))
                want_c = tuple(block[0] + k % u + u * j for j in range(c))
                assert (ug is None) == (u == 1) and (u == 1 or ug == ("group", want_u) or want_u == tuple(range(world)))
                assert cg == ("group", want_c) or (want_c == tuple(range(world)) and cg is dist.group.WORLD)
                assert want_c in made and (u == 1 or want_u in made)
            assert split_subgroups(block, c)[1] == [tuple(block[0] + a + u * j for j in range(c)) for a in range(u)]
    with pytest.raises(KeyError, match="no process groups for a group of 4 split 1x4 .* this run has"):
        GroupRegistry(world, degrees).subgroups(range(4), 4, 0)
    with pytest.raises(ValueError, match=r"shape \(4, 3\): the context-parallel size 3 does not divide the degree 4"):
        GroupRegistry(world, degrees, shapes=[(4, 3)])
