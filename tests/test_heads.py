import pytest

from cel_utils.models.heads import HeadGeometry, HeadId, format_heads, head_set, parse_head


def test_printable_form_round_trips():
    for head in [HeadId(0, 0), HeadId(12, 3), HeadId(29, 8)]:
        assert parse_head(str(head)) == head
    assert str(HeadId(12, 3)) == "L12.H3"


@pytest.mark.parametrize("text", ["12.3", "L12H3", "l12.h3", "L-1.H2", "L1.H", ""])
def test_malformed_head_ids_are_rejected(text):
    with pytest.raises(ValueError, match="L<layer>.H<head>"):
        parse_head(text)


def test_head_sets_are_canonical():
    assert head_set(["L3.H1", (1, 2), HeadId(3, 1)]) == (HeadId(1, 2), HeadId(3, 1))
    assert format_heads([HeadId(10, 0), HeadId(2, 5)]) == "L2.H5+L10.H0"  # numeric, not string, order
    assert format_heads([]) == "(none)"


def test_geometry_rejects_heads_outside_the_model():
    geometry = HeadGeometry(n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64)
    assert len(geometry.all_heads()) == 270
    geometry.check(HeadId(29, 8))
    with pytest.raises(ValueError, match="outside the model"):
        geometry.check(HeadId(30, 0))
    with pytest.raises(ValueError, match="outside the model"):
        geometry.check(HeadId(0, 9))
