import numpy as np
import pytest

from mambaserve.engine.batch import Batch, Row
from mambaserve.metadata import build_metadata


def R(tokens, ctx, slot, init, pages):
    return Row.standalone(tokens, ctx, slot, init, pages)


def build(rows, decodes=(), chunk=8, K=4, page=4):
    return build_metadata(Batch(list(rows), list(decodes)), chunk_size=chunk, conv_kernel=K,
                          page_size=page, scratch_page=99, device="cpu")


def test_chunks_split_at_absolute_multiples_and_never_span_rows():
    rows = [R(list(range(13)), 5, 0, True, [0, 1, 2, 3, 4]),
            R(list(range(8)), 0, 1, False, [5, 6]),
            R(list(range(3)), 17, 2, True, [7, 8, 9, 10, 11])]
    m = build(rows, [R([1], 9, 3, True, [12, 13, 14])])
    assert (m.num_prefills, m.num_prefill_tokens, m.num_decodes, m.num_tokens) == (3, 24, 1, 25)
    idx = m.prefill.chunk_token_idx.numpy()
    token_row = m.token_row.numpy()
    positions = m.positions.numpy()
    lens = [(c < 24).sum() for c in idx]
    # row 0 covers positions 5..17: chunks [5,8) [8,16) [16,18); row 1: [0,8); row 2: [17,20)
    assert lens == [3, 8, 2, 8, 3]
    for c in idx:
        real = c[c < 24]
        assert len(set(token_row[real])) == 1
        assert len(set(positions[real] // 8)) == 1  # one absolute chunk_size block
    assert m.prefill.row_num_chunks.tolist() == [3, 1, 1]
    assert m.prefill.row_chunks.tolist() == [[0, 1, 2], [3, 5, 5], [4, 5, 5]]
    assert positions[-1] == 9 and m.state_slots.tolist() == [0, 1, 2, 3]


def test_row_spans_of_the_prefill_rows():
    """(first token, tokens, context_len) of each prefill row, for the attention's choice of
    kernel; decode rows have none."""
    rows = [R([1, 2, 3], 5, 0, True, [0, 1]), R([4] * 6, 0, 1, False, [2, 3])]
    m = build(rows, [R([1], 9, 2, True, [4, 5, 6])])
    assert m.prefill.row_spans == ((0, 3, 5), (3, 6, 0))


def test_conv_windows_and_pages():
    rows = [R([10, 11], 6, 0, True, [3, 7]), R([20, 21, 22, 23, 24], 0, 1, False, [5, 2])]
    m = build(rows)
    K1 = 3
    # extended stream = 2 rows * 3 saved inputs, then 7 new tokens
    # row 0 token 0: the saved window, then itself
    assert m.prefill.conv_window_idx[0].tolist() == [0, 1, 2, 6]
    assert m.prefill.conv_window_idx[1].tolist() == [1, 2, 6, 7]
    assert m.prefill.conv_window_idx[6].tolist() == [2 * K1 + 3, 2 * K1 + 4, 2 * K1 + 5,
                                                     2 * K1 + 6]
    # a short row keeps part of its old window
    assert m.prefill.conv_state_idx[0].tolist() == [2, 6, 7]
    assert m.prefill.conv_state_idx[1].tolist() == [2 * K1 + 4, 2 * K1 + 5, 2 * K1 + 6]
    # positions 6,7 of row 0 -> page 7 (second page) offsets 2,3; row 1 pos 0..4 -> pages 5,5,5,5,2
    assert m.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 20, 21, 22, 23, 8]
    assert m.page_table.tolist() == [[3, 7], [5, 2]]
    assert m.max_kv_len == 8


def test_one_upload_buffer():
    rows = [R([1, 2, 3], 0, 0, False, [0])]
    m = build(rows)
    base = m.input_ids.untyped_storage().data_ptr()
    for t in (m.positions, m.state_slots, m.prefill.chunk_token_idx, m.slot_mapping, m.logits_idx,
              m.prefill.has_initial_state):
        assert t.untyped_storage().data_ptr() == base
    assert m.logits_idx.tolist() == [2]


def test_decode_rows_must_have_one_token():
    with pytest.raises(ValueError, match="exactly one token"):
        build([], [R([1, 2], 3, 0, True, [0])])
    assert np.array_equal(build([], [R([4], 3, 0, True, [0])]).input_ids.numpy(), [4])


def _reference_prefill_plan(rows, chunk, K):
    """The SSD chunk grid and conv windows by plain loops over tokens (what the vectorized
    `plan_metadata` must equal): chunks split each row at absolute multiples of `chunk`, a
    chunk's tokens from slot 0; a token's conv window reaches the row's K-1 saved inputs (the
    extended stream's head) before its first token."""
    P, K1 = len(rows), K - 1
    starts = np.cumsum([0] + [len(r.token_ids) for r in rows])
    Tp = int(starts[-1])
    chunks, row_chunks = [], []
    for r, row in enumerate(rows):
        ids, cur = [], None
        for i in range(row.num_tokens):
            c = (row.context_len + i) // chunk
            if c != cur:
                ids.append(len(chunks))
                chunks.append([])
                cur = c
            chunks[-1].append(int(starts[r]) + i)
        row_chunks.append(ids)
    chunk_token_idx = np.full((len(chunks), chunk), Tp)
    token_chunk_pos = np.zeros(Tp, dtype=np.int64)
    for c, toks in enumerate(chunks):
        for j, t in enumerate(toks):
            chunk_token_idx[c, j] = t
            token_chunk_pos[t] = c * chunk + j
    width = max(len(ids) for ids in row_chunks)
    rc = np.array([ids + [len(chunks)] * (width - len(ids)) for ids in row_chunks])
    windows = []
    for r, row in enumerate(rows):
        for i in range(row.num_tokens):
            windows.append([r * K1 + u if u < K1 else P * K1 + int(starts[r]) + u - K1
                            for u in range(i, i + K)])
    return {"chunk_token_idx": chunk_token_idx, "token_chunk_pos": token_chunk_pos,
            "row_chunks": rc, "row_num_chunks": np.array([len(ids) for ids in row_chunks]),
            "conv_window_idx": np.array(windows)}


@pytest.mark.parametrize("seed", range(6))
def test_chunk_grid_and_conv_windows_match_a_loop_over_tokens(seed):
    rng = np.random.default_rng(seed)
    chunk, K = [8, 16, 128][seed % 3], [2, 3, 4][seed // 2 % 3]
    rows = []
    for i in range(int(rng.integers(1, 5))):
        ctx, n = int(rng.integers(0, 300)), int(rng.integers(1, 300))
        pages = list(range(100 * i, 100 * i + (ctx + n) // 4 + 1))
        rows.append(R(list(rng.integers(0, 50, n)), ctx, i, ctx > 0, pages))
    decodes = [R([1], 7, 9, True, [500, 501])] if seed % 2 else []
    m = build(rows, decodes, chunk=chunk, K=K)
    ref = _reference_prefill_plan(rows, chunk, K)
    for name, want in ref.items():
        assert np.array_equal(getattr(m.prefill, name).numpy(), want), name
    assert m.prefill.num_chunks == len(ref["chunk_token_idx"])


def test_snapshots_per_chunk_for_the_scan():
    """chunk_snap_dst: the snapshot slot of each chunk's end (-1: none), the same snapshots as
    the snap_dst list."""
    rows = [R(list(range(13)), 5, 0, True, [0, 1, 2, 3, 4]),  # chunks [5,8) [8,16) [16,18)
            R(list(range(8)), 0, 1, False, [5, 6])]  # chunk [0,8)
    rows[0].snapshots = [(8, 40), (18, 41)]  # the ends of its first and last chunk
    rows[1].snapshots = [(8, 42)]
    m = build(rows)
    pf = m.prefill
    assert pf.snap_dst.tolist() == [40, 41, 42]
    assert pf.chunk_snap_dst.tolist() == [40, -1, 41, 42]
    assert build([R(list(range(3)), 0, 0, False, [0])]).prefill.chunk_snap_dst.tolist() == [-1]
