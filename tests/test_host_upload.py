import numpy as np
import pytest
import torch

from mambaserve.host_upload import PinnedStaging, copy_into, layout, pack, upload


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


def test_copy_into_a_view_takes_an_array_of_its_dtype_within_its_size():
    buf = torch.full((8,), -1, dtype=torch.int64)
    copy_into(np.array([3, 4, 5], dtype=np.int64), buf[2:5])
    assert buf.tolist() == [-1, -1, 3, 4, 5, -1, -1, -1]
    for host, dst in ((np.zeros(4, np.int64), buf[:3]), (np.zeros(3, np.int32), buf[:3]),
                      (np.zeros(3, np.int64), buf[::2][:3])):
        with pytest.raises(ValueError, match="cannot copy"):
            copy_into(host, dst)


class _Event:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


class _CpuStaging(PinnedStaging):
    """The buffer rules on a CPU: plain tensors for pinned ones, events finished by hand."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.allocs, self.recorded = [], []

    def _alloc(self, nbytes):
        self.allocs.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    def _event(self):
        return _Event()

    def _record(self, event, device):
        event.done = False
        self.recorded.append(event)


def _upload(st, parts):
    offsets, total = layout({k: (a.dtype, a.shape) for k, a in parts.items()})
    out = st.copy(parts, offsets, max(total, 16), torch.device("cpu"))
    return out, {k: out[o: o + a.nbytes].view(torch.int64) for (k, a), o in
                 zip(parts.items(), offsets.values())}


def test_pinned_staging_reuses_a_buffer_only_after_its_copy_finished():
    st = _CpuStaging(slots=2, min_bytes=64)
    a = {"x": np.arange(4, dtype=np.int64)}
    _, got = _upload(st, a)
    assert got["x"].tolist() == [0, 1, 2, 3] and st.allocs == [64]
    first = st.bufs[0][0]
    _upload(st, {"x": np.arange(4, 8, dtype=np.int64)})  # slot 0 in flight: slot 1
    assert st.allocs == [64, 64] and first[:32].view(torch.int64).tolist() == [0, 1, 2, 3]
    # both in flight: a fresh buffer of the exact size, neither slot is written
    _, got = _upload(st, {"x": np.full(4, 9, dtype=np.int64)})
    assert st.allocs == [64, 64, 32] and got["x"].tolist() == [9] * 4
    assert first[:32].view(torch.int64).tolist() == [0, 1, 2, 3]
    st.recorded[0].done = True  # slot 0's copy ran: taken again, no allocation
    _upload(st, {"x": np.full(4, 7, dtype=np.int64)})
    assert st.allocs == [64, 64, 32] and st.bufs[0][0] is first
    assert first[:32].view(torch.int64).tolist() == [7] * 4
    # a larger upload grows its slot to a power of two
    for e in st.recorded:
        e.done = True
    _, got = _upload(st, {"x": np.arange(20, dtype=np.int64)})
    assert st.allocs[-1] == 256 and got["x"].tolist() == list(range(20))


def test_pinned_staging_copies_into_a_given_tensor():
    st = _CpuStaging(slots=1, min_bytes=64)
    dst = torch.zeros(48, dtype=torch.uint8)
    out = st.copy({"x": np.arange(4, dtype=np.int64)}, {"x": 0}, 32, torch.device("cpu"),
                  into=dst[8:40])
    assert out.data_ptr() == dst[8:].data_ptr()
    assert dst[8:40].view(torch.int64).tolist() == [0, 1, 2, 3] and not dst[:8].any()
    # the slot still in flight: a fresh buffer, the same destination rule
    st.copy({"x": np.full(2, 5, dtype=np.int64)}, {"x": 0}, 16, torch.device("cpu"),
            into=dst[:16])
    assert st.allocs == [64, 16] and dst[:16].view(torch.int64).tolist() == [5, 5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_copy_into_behind_a_busy_stream_keeps_each_value():
    a = torch.randn(4096, 4096, device="cuda")
    dst = torch.zeros(12, 64, dtype=torch.int64, device="cuda")
    for i in range(12):
        b = a @ a  # keeps the stream busy while the copies queue up
        copy_into(np.arange(i, i + 64, dtype=np.int64), dst[i])
    torch.cuda.synchronize()
    del b
    assert dst.cpu().tolist() == [list(range(i, i + 64)) for i in range(12)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_uploads_behind_a_busy_stream_keep_their_values():
    """Uploads queued behind a long kernel: each keeps its own values (a staging buffer still
    waiting for its copy is not overwritten), whatever the sizes."""
    a = torch.randn(4096, 4096, device="cuda")
    outs, want = [], []
    for i in range(12):
        b = a @ a  # keeps the stream busy while the uploads queue up
        parts = {"x": np.arange(i, i + 100 * (i % 5 + 1), dtype=np.int64),
                 "y": np.full((3, i + 1), i, dtype=np.int32)}
        outs.append(upload(parts, "cuda"))
        want.append(parts)
    torch.cuda.synchronize()
    del b
    for out, parts in zip(outs, want):
        for k, v in parts.items():
            assert np.array_equal(out[k].cpu().numpy(), v), k


def test_the_layout_is_looked_up_by_names_dtypes_and_shapes():
    """Computed once per set of names, dtypes and shapes: uploads of other values reuse it,
    another shape gets its own, and what `layout` returns is the caller's to change."""
    def specs(parts):
        return {k: (a.dtype, a.shape) for k, a in parts.items()}

    a = {"x": np.arange(3, dtype=np.int64), "y": np.array([0.5, 2.0], np.float32)}
    b = {"x": np.arange(5, dtype=np.int64), "y": np.array([1.5, 3.0], np.float32)}
    assert layout(specs(a)) == ({"x": 0, "y": 32}, 48)
    assert layout(specs(b)) == ({"x": 0, "y": 48}, 64)
    layout(specs(a))[0]["x"] = 99
    assert layout(specs(a))[0]["x"] == 0
    for parts in (a, b, {k: v * 2 for k, v in a.items()}):
        out = upload(parts, "cpu")
        assert all(np.array_equal(out[k].numpy(), v) for k, v in parts.items())
