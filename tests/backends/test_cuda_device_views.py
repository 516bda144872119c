"""Views of Numba device arrays (a decoder's cache up to its length), made without a GPU over memory
that is never touched, against Numba's own ``__getitem__``."""

import contextlib
import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("numba_cuda") is None, reason="the cuda extra (numba-cuda) is not installed"
)


@pytest.fixture
def device_array(monkeypatch):
    """A maker of Numba device arrays over a made-up address (nothing reads or writes it:
    ``benchmarks.host_path.made_up_array``), and Numba's context check, which needs a driver, left out
    of its own ``__getitem__``."""
    from numba.cuda.cudadrv import devices

    from benchmarks.host_path import made_up_array

    monkeypatch.setattr(devices._runtime, "ensure_context", contextlib.nullcontext)
    return made_up_array


def _described(x):
    return (
        tuple(x.shape),
        tuple(x.strides),
        x.dtype,
        x.device_ctypes_pointer.value,
        x.gpu_data.size,
        x.alloc_size,
        x._numba_type_,
        x.stream,
    )


@pytest.mark.parametrize(
    "shape,index",
    [
        ((1, 8, 64, 16), (slice(None), slice(None), slice(0, 40))),  # a cache up to its length: 8 x 40 runs
        ((1, 8, 64, 16), (slice(None), slice(None), slice(0, 64))),  # up to max_len: the whole array
        ((2, 3, 10, 4), (slice(None), slice(1, 3), slice(2, 7))),  # heads and positions
        ((5, 6), (slice(0, 1), slice(None))),  # one position
        ((9, 4, 6), (slice(1, 8, 2), slice(None), slice(0, 5))),  # a step along the first axis
        ((6, 4), slice(2, 5)),  # one slice, not a tuple
    ],
)
def test_device_views_are_numbas_own(device_array, shape, index):
    from attncomp.backends.numba_cuda.host import arrays

    x = device_array(shape)
    assert _described(arrays.sliced(x, index)) == _described(x[index])
    inner = x[(slice(None),) * (len(shape) - 1) + (slice(1, shape[-1]),)] if shape[-1] > 1 else x
    assert _described(arrays.sliced(inner, index)) == _described(inner[index])  # a view of a view


def test_a_decoders_prefix_and_bf16_patterns_take_the_same_views(device_array):
    from attncomp.backends.numba_cuda.host import arrays

    cache = device_array((1, 8, 64, 16))
    assert _described(arrays.prefix(cache, 2, 40)) == _described(cache[:, :, :40])
    bits = arrays.Bf16Bits(device_array((1, 8, 64, 16), np.uint16))
    assert _described(bits[:, :, :40].bits) == _described(bits.bits[:, :, :40])
    assert arrays.sliced(np.zeros((4, 3)), (slice(0, 2),)).shape == (2, 3)  # host arrays: numpy's own
    with pytest.raises(IndexError):
        arrays.sliced(cache, (slice(None),) * 5)  # Numba's own error for too many indices
