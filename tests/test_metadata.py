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
    assert m.prefill.conv_window_idx[0].tolist() == [0, 1, 2, 6]  # row 0 token 0: saved window + itself
    assert m.prefill.conv_window_idx[1].tolist() == [1, 2, 6, 7]
    assert m.prefill.conv_window_idx[6].tolist() == [2 * K1 + 3, 2 * K1 + 4, 2 * K1 + 5, 2 * K1 + 6]
    assert m.prefill.conv_state_idx[0].tolist() == [2, 6, 7]  # short row keeps part of its old window
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
