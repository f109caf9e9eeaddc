import io

from hypothesis import given
from hypothesis import strategies as st

from dropless.data._sources import _pieces, cut_texts

texts = st.text(st.sampled_from("ab \n€😀é"), max_size=200)


@given(texts, st.integers(4, 40))
def test_pieces(text, limit):
    """Pieces rejoin to the text, fit the limit, are whole UTF-8, and a piece with a line end
    ends at one (but the last)."""
    pieces = list(_pieces(io.BytesIO(text.encode()).read, limit))
    assert b"".join(pieces) == text.encode()
    for piece in pieces:
        assert 0 < len(piece) <= limit
        piece.decode("utf-8")
    for piece in pieces[:-1]:
        assert b"\n" not in piece or piece.endswith(b"\n")


@given(st.lists(texts, max_size=5), st.integers(4, 40))
def test_cut_texts(records, limit):
    cut = list(cut_texts([(t, 1) for t in records], limit))
    assert "".join(t for t, _ in cut) == "".join(records)
    assert sum(n for _, n in cut) == len(records)
    assert all(len(t.encode()) <= limit for t, _ in cut)
