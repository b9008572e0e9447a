"""The driver launch path's parameter block (moonep/planner/cuda.py _DriverLaunch), checked without a GPU:
cuLaunchKernel is replaced by a recorder that reads the parameters back through the pointer array, as the
driver does."""
import ctypes

import pytest

from moonep.planner import cuda


class _Fn:
    ptr = 0x1234


@pytest.fixture
def recorder(monkeypatch):
    calls = []

    def fake(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        n = 13
        ptrs = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        vals = [ctypes.c_int64.from_address(ptrs[i]).value for i in range(n)]
        calls.append((fn, gx, gy, gz, bx, by, bz, smem, stream, vals, extra))
        return 0

    monkeypatch.setattr(cuda._DriverLaunch, "_fn", fake)
    return calls


def test_driver_launch_params(recorder):
    d = cuda._DriverLaunch.make(_Fn(), 73, 256, 27648, 13, {2: 8, 3: 256, 4: 76, 5: -1, 8: 32768, 9: 7, 10: 1,
                                                             11: (1 << 40) | 5})
    for k in range(2):  # a second call rewrites only the changing words
        v = d.vals
        v[0], v[1], v[6], v[7], v[12] = 100 + k, 200 + k, 300 + k, 400 + k, (1 << 55) + k
        d.launch(0xABC)
    fn, gx, gy, gz, bx, by, bz, smem, stream, vals, extra = recorder[-1]
    assert (fn, gx, gy, gz, bx, by, bz, smem, stream, extra) == (0x1234, 73, 1, 1, 256, 1, 1, 27648, 0xABC, None)
    assert vals == [101, 201, 8, 256, 76, -1, 301, 401, 32768, 7, 1, (1 << 40) | 5, (1 << 55) + 1]


def test_driver_launch_error(monkeypatch):
    monkeypatch.setattr(cuda._DriverLaunch, "_fn", lambda *a: 719)
    d = cuda._DriverLaunch.make(_Fn(), 1, 32, 0, 13, {})
    with pytest.raises(RuntimeError, match="CUresult 719"):
        d.launch(0)


def test_no_function_handle():
    class NoPtr:
        pass

    assert cuda._DriverLaunch.make(NoPtr(), 1, 32, 0, 13, {}) is None
