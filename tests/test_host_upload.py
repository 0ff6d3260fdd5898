import numpy as np
import pytest
import torch

from mambaserve.host_upload import copy_into, pack, upload


def test_upload_views_every_part_with_its_dtype_and_shape_in_one_buffer():
    parts = {"a": np.arange(5, dtype=np.int64), "b": np.array([1.5, -2.25], dtype=np.float32),
             "c": np.array([7, 8, 9], dtype=np.int32), "d": np.array([True, False, True]),
             "e": np.arange(6, dtype=np.int64).reshape(2, 3), "empty": np.zeros((0, 3), np.int64)}
    out = upload(parts, "cpu")
    for name, a in parts.items():
        t = out[name]
        assert tuple(t.shape) == a.shape, name
        assert np.array_equal(t.numpy(), a), name
    assert out["b"].dtype == torch.float32 and out["c"].dtype == torch.int32
    assert out["d"].dtype == torch.bool and out["e"].dtype == torch.int64
    base = out["a"].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in out.values())


def test_pack_aligns_every_part_to_16_bytes():
    """Triton specializes pointers on 16-byte alignment: every view must have it whatever the
    sizes before it, or a kernel compiles again for a new batch shape."""
    buf, offsets = pack({"x": np.array([1, 2, 3], np.int32), "y": np.array([4], np.int64),
                         "z": np.array([True]), "w": np.array([5, 6, 7], np.int64)})
    assert offsets == {"x": 0, "y": 16, "z": 32, "w": 48} and buf.size == 80
    assert buf[16:24].view(np.int64)[0] == 4 and buf[48:72].view(np.int64).tolist() == [5, 6, 7]


def test_unsupported_dtype_is_named():
    with pytest.raises(TypeError, match="'w' has dtype float64"):
        upload({"w": np.zeros(2)}, "cpu")


def test_copy_into_fills_the_prefix_of_a_device_buffer():
    dst = torch.full((6,), -1, dtype=torch.int64)
    copy_into(np.array([3, 4, 5], dtype=np.int64), dst)
    assert dst.tolist() == [3, 4, 5, -1, -1, -1]
