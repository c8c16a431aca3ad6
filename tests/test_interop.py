"""cufuse.from_torch / cufuse.to_torch (zero-copy, stream-ordered) and the
torch CUDA path of the ops (torch's current stream)."""
from __future__ import annotations

import numpy as np
import pytest

import cufuse

from _reference import ARITY, OP_NAMES, OPS, assert_close, rand, reference

F32 = np.dtype(np.float32)


def _torch():
    return pytest.importorskip("torch")


def _torch_cuda():
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("bad", [np.zeros(3, F32), [1.0, 2.0], 1.0, None], ids=["ndarray", "list", "float", "None"])
def test_from_torch_rejects_non_tensor(bad):
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        cufuse.from_torch(bad)


@pytest.mark.parametrize("bad", [[1.0, 2.0], 1.0, "x"], ids=["list", "float", "str"])
def test_to_torch_rejects_non_array(bad):
    _torch()
    with pytest.raises(TypeError, match="expected a numpy.ndarray or cupy.ndarray"):
        cufuse.to_torch(bad)


def test_to_torch_refuses_read_only_arrays(tmp_path):
    """A read-only array (a read-only memory map, np.frombuffer of bytes): a tensor sharing its memory
    could be written (a write to the memory map crashed the process, one to bytes changed them)."""
    pytest.importorskip("torch")
    f = tmp_path / "m.bin"
    np.ones(4, np.float32).tofile(f)
    for a in (np.memmap(f, dtype=np.float32, mode="r"), np.frombuffer(b"\x00" * 16, np.float32)):
        with pytest.raises(ValueError, match="read-only.*pass a.copy"):
            cufuse.to_torch(a)
    assert cufuse.to_torch(np.frombuffer(bytearray(16), np.float32)).shape == (4,)


def test_conversions_torch_cannot_share_say_why():
    """A conjugate-bit tensor, a reversed view, a big-endian array: cufuse's errors with what to pass
    (torch's own RuntimeError and ValueErrors came through)."""
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="conjugate bit.*resolve_conj"):
        cufuse.from_torch(torch.ones(2, dtype=torch.complex64).conj())
    with pytest.raises(ValueError, match="negative strides.*a.copy"):
        cufuse.to_torch(np.arange(4.0)[::-1])
    with pytest.raises(ValueError, match="byte order.*newbyteorder"):
        cufuse.to_torch(np.arange(4.0).astype(">f8"))


def test_arrays_whose_memory_is_not_their_values():
    """np.matrix (its * is a matrix product: the fallbacks' math gave
    products), a masked array given to to_torch (its mask dropped), and a
    torch tensor with its negative bit set (DLPack and the kernels read the
    un-negated memory) are refused, each with its way out."""
    torch = _torch()
    m = np.matrix([[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(TypeError, match="numpy.matrix"):
        cufuse.fma(m, np.matrix(np.eye(2)), 0.0)
    with pytest.raises(TypeError, match="cufuse.to_torch: got a numpy.ma.MaskedArray"):
        cufuse.to_torch(np.ma.masked_array([1.0, 2.0], [True, False]))
    neg = torch.tensor([1 + 2j, 3 - 4j]).conj().imag  # tensor([-2., 4.]) in memory [2, -4]
    assert neg.is_neg()
    with pytest.raises(TypeError, match="negative bit"):
        cufuse.from_torch(neg)
    with pytest.raises(TypeError, match="negative bit"):
        cufuse.add_relu(neg, 0.0)
    np.testing.assert_array_equal(cufuse.add_relu(neg.resolve_neg(), 0.0).numpy(), [0.0, 4.0])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_out_bumps_torch_version(device):
    """A torch out= written by cufuse counts as an in-place change, as torch's
    own out= does: a backward that saved the tensor raises (it read the new
    values and gave a wrong gradient, silently)."""
    torch = _torch() if device == "cpu" else _torch_cuda()
    from cufuse import image
    pipe = image.Pipeline().resize((3, 4))  # one pipeline: its second call takes the fast path
    frame = torch.randint(0, 256, (10, 12, 3), dtype=torch.uint8, device=device)
    for shape, write in (((3, 4), lambda t: cufuse.add_relu(torch.full((3, 4), 10.0, device=device), 1.0, out=t)),
                         ((3, 4), lambda t: cufuse.softmax(torch.rand(3, 4, device=device), out=t)),
                         ((1, 3, 3, 4), lambda t: pipe(frame, [(0, 0, 12, 10)], out=t)),
                         ((1, 3, 3, 4), lambda t: pipe(frame, [(0, 0, 12, 10)], out=t))):
        w = torch.ones(shape, device=device, requires_grad=True)
        t = torch.rand(shape, device=device)
        y = (w * t).sum()  # t saved for the backward
        before = t._version
        write(t)
        assert t._version > before
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()
    # under no_grad too, as torch's out=: a graph recorded before still reads the tensor
    w = torch.ones(3, 4, device=device, requires_grad=True)
    t = torch.rand(3, 4, device=device)
    y = (w * t).sum()
    with torch.no_grad():
        cufuse.add_relu(torch.full((3, 4), 10.0, device=device), 1.0, out=t)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    with torch.inference_mode():  # an inference tensor keeps no version: written all the same
        t = torch.rand(3, 4, device=device)
    with torch.enable_grad():
        cufuse.add_relu(torch.full((3, 4), 10.0, device=device), 1.0, out=t)
    assert float(t.min()) == 11.0


# --------------------------------------------------------------- CPU: NumPy
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_from_torch_cpu_shares_memory(layout):
    torch = _torch()
    t = torch.from_numpy(rand((6, 8), F32, 1))
    if layout == "transposed":
        t = t.T
    elif layout == "sliced":
        t = t[1:, ::2]
    a = cufuse.from_torch(t)
    assert isinstance(a, np.ndarray)
    assert a.ctypes.data == t.data_ptr()
    assert a.shape == tuple(t.shape)
    assert a.strides == tuple(s * a.itemsize for s in t.stride())
    np.testing.assert_array_equal(a, t.numpy())
    a[1, 2] = 1234.5                       # write through NumPy, seen by torch
    assert t[1, 2].item() == 1234.5
    t[0, 1] = -77.25                       # write through torch, seen by NumPy
    assert a[0, 1] == np.float32(-77.25)


def test_from_torch_cpu_requires_grad_is_detached_view():
    torch = _torch()
    t = torch.from_numpy(rand((5,), F32, 2)).requires_grad_(True)
    a = cufuse.from_torch(t)
    assert isinstance(a, np.ndarray) and a.ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(a, t.detach().numpy())


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_to_torch_cpu_shares_memory(layout):
    torch = _torch()
    a = rand((6, 8), F32, 3)
    if layout == "transposed":
        a = a.T
    t = cufuse.to_torch(a)
    assert isinstance(t, torch.Tensor) and t.device.type == "cpu"
    assert t.data_ptr() == a.ctypes.data
    assert t.dtype == torch.float32 and tuple(t.shape) == a.shape
    np.testing.assert_array_equal(t.numpy(), a)
    t[2, 3] = 99.5
    assert a[2, 3] == np.float32(99.5)
    a[0, 0] = -3.25
    assert t[0, 0].item() == -3.25


def test_cpu_round_trip_through_an_op():
    torch = _torch()
    x, y = rand((100,), F32, 4), rand((100,), F32, 5)
    tx, ty = torch.from_numpy(x.copy()), torch.from_numpy(y.copy())
    res = cufuse.add_relu(cufuse.from_torch(tx), cufuse.from_torch(ty))   # NumPy in, NumPy out
    assert isinstance(res, np.ndarray)
    tres = cufuse.to_torch(res)
    assert tres.data_ptr() == res.ctypes.data
    assert_close(tres.numpy(), reference("add_relu", [x, y], F32), F32)


# ---------------------------------------------------------------- GPU: CuPy
@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_from_torch_cuda_zero_copy(layout):
    torch = _torch_cuda()
    import cupy as cp
    t = torch.from_numpy(rand((6, 8), F32, 6)).cuda()
    if layout == "transposed":
        t = t.T
    elif layout == "sliced":
        t = t[1:, ::2]
    a = cufuse.from_torch(t)
    assert isinstance(a, cp.ndarray)
    assert a.data.ptr == t.data_ptr()
    assert a.data.device_id == t.get_device()
    assert a.shape == tuple(t.shape)
    assert a.strides == tuple(s * a.itemsize for s in t.stride())
    np.testing.assert_array_equal(cp.asnumpy(a), t.cpu().numpy())
    a[1, 2] = 1234.5                       # write through CuPy ...
    cp.cuda.get_current_stream().synchronize()
    assert t[1, 2].item() == 1234.5        # ... seen by torch
    t[0, 1] = -77.25                       # write through torch ...
    torch.cuda.synchronize()
    assert float(a[0, 1].get()) == -77.25  # ... seen by CuPy


@pytest.mark.cuda
def test_to_torch_cuda_zero_copy():
    torch = _torch_cuda()
    import cupy as cp
    a = cp.asarray(rand((6, 8), F32, 7))
    t = cufuse.to_torch(a)
    assert isinstance(t, torch.Tensor) and t.is_cuda
    assert t.data_ptr() == a.data.ptr and t.get_device() == a.data.device_id
    assert tuple(t.shape) == a.shape and t.dtype == torch.float32
    t[2, 3] = 99.5
    torch.cuda.synchronize()
    assert float(a[2, 3].get()) == 99.5
    a[0, 0] = -3.25
    cp.cuda.get_current_stream().synchronize()
    assert t[0, 0].item() == -3.25


_BIG = 1 << 26  # 256 MB of float32: long enough writes to expose a missing wait


def _scaled_ones(steps):
    v = np.float32(1.0)
    for _ in range(steps):
        v = np.float32(v * np.float32(1.5))
    return v


@pytest.mark.cuda
def test_from_torch_is_stream_ordered():
    """torch writes a big tensor on a side stream; CuPy reads it on its own
    current stream after from_torch (called in that stream context)."""
    torch = _torch_cuda()
    import cupy as cp
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = torch.ones(_BIG, device="cuda")
        for _ in range(8):
            t.mul_(1.5)
        a = cufuse.from_torch(t)
    assert a.data.ptr == t.data_ptr()
    n_bad = int(cp.count_nonzero(a != _scaled_ones(8)).get())   # on CuPy's current stream
    assert n_bad == 0


@pytest.mark.cuda
def test_to_torch_is_stream_ordered():
    """CuPy writes a big array on a non-blocking stream; torch reads it on its
    current stream after to_torch (called in that CuPy stream context)."""
    torch = _torch_cuda()
    import cupy as cp
    cs = cp.cuda.Stream(non_blocking=True)
    with cs:
        a = cp.ones(_BIG, dtype=F32)
        for _ in range(8):
            a *= np.float32(1.5)
        t = cufuse.to_torch(a)
    assert t.data_ptr() == a.data.ptr
    n_bad = int((t != float(_scaled_ones(8))).sum().item())     # on torch's current stream
    assert n_bad == 0


# ----------------------------------------------------- ops on torch CUDA tensors
@pytest.mark.cuda
@pytest.mark.parametrize("op", OP_NAMES)
@pytest.mark.parametrize("second", ["same_shape", "scalar", "row"])  # fast path, general paths
def test_torch_cuda_op_uses_current_stream(op, second, launches):
    """Inputs produced by a long torch op on a side stream are read correctly
    when the op is called in that stream's context; the kernel is queued on it."""
    torch = _torch_cuda()
    shape = (2048, 4096)
    base = torch.from_numpy(rand(shape, F32, 8, scale=0.1)).cuda()
    other = torch.from_numpy(rand(shape, F32, 9, scale=0.1)).cuda()
    row = torch.from_numpy(rand((shape[1],), F32, 10, scale=0.1)).cuda()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = base.clone()
        for _ in range(20):          # a long producer on s
            a.add_(0.125)
        b = {"same_shape": other, "scalar": 0.25, "row": row}[second]
        args = [a] + [b] * (ARITY[op] - 1)
        y = OPS[op](*args)
    s.synchronize()
    assert isinstance(y, torch.Tensor) and y.device == a.device
    assert len(launches) == 1
    assert launches[0].stream is not None and launches[0].stream.ptr == s.cuda_stream
    np_in = [x.cpu().numpy() if isinstance(x, torch.Tensor) else x for x in args]
    assert_close(y.cpu().numpy(), reference(op, np_in, F32), F32)


@pytest.mark.cuda
def test_torch_cuda_op_with_out_on_side_stream(launches):
    torch = _torch_cuda()
    x, z = rand((1000,), F32, 11), rand((1000,), F32, 12)
    tx, tz = torch.from_numpy(x).cuda(), torch.from_numpy(z).cuda()
    out = torch.full((1000,), float("nan"), device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        res = cufuse.mul_tanh(tx, tz, out=out)
    s.synchronize()
    assert res is out
    assert len(launches) == 1 and launches[0].stream.ptr == s.cuda_stream
    assert_close(out.cpu().numpy(), reference("mul_tanh", [x, z], F32), F32)


@pytest.mark.cuda
def test_gpu_round_trip_through_an_op(launches):
    torch = _torch_cuda()
    import cupy as cp
    x, y = rand((4097,), F32, 13), rand((4097,), F32, 14)
    tx, ty = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()
    res = cufuse.fma(cufuse.from_torch(tx), cufuse.from_torch(ty), 0.5)   # CuPy in, CuPy out
    assert isinstance(res, cp.ndarray) and len(launches) == 1
    tres = cufuse.to_torch(res)
    assert tres.data_ptr() == res.data.ptr
    assert_close(tres.cpu().numpy(), reference("fma", [x, y, 0.5], F32), F32)

