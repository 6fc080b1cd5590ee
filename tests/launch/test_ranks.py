import pytest

from launcher.launch.display.lines import format_ranks, parse_ranks


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([0], "0"),
        ([0, 1, 2, 3], "0-3"),
        ([8, 7, 5, 3, 2, 1, 0, 3, 7], "0-3,5,7-8"),
        ([1, 3, 5], "1,3,5"),
        ([4, 5], "4-5"),
        ([], ""),
        (range(16), "0-15"),
    ],
)
def test_format_ranks_sorts_dedupes_and_joins_runs(ranks, text):
    assert format_ranks(ranks) == text


@pytest.mark.parametrize(
    ("text", "ranks"),
    [
        ("0", {0}),
        ("0,2-3", {0, 2, 3}),
        (" 1 , 4-6 ", {1, 4, 5, 6}),
        ("3-3", {3}),
        ("2,1,2", {1, 2}),
        ("10-12,0", {0, 10, 11, 12}),
    ],
)
def test_parse_ranks(text, ranks):
    assert parse_ranks(text) == frozenset(ranks)


def test_parse_then_format_round_trips():
    assert format_ranks(parse_ranks("7-8,0-3,5")) == "0-3,5,7-8"


EXPECTED = "use a comma-separated list such as 0,2-3"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a", f"--ranks: 'a' is not a rank or rank range; {EXPECTED}"),
        ("3-1", f"--ranks: '3-1' is not a rank range; {EXPECTED}"),
        ("-1", f"--ranks: '-1' is not a rank or rank range; {EXPECTED}"),
        ("", f"--ranks: expected at least one rank; {EXPECTED}"),
        ("  ", f"--ranks: expected at least one rank; {EXPECTED}"),
        ("0,,2", f"--ranks: '' is not a rank or rank range; {EXPECTED}"),
        ("1-", f"--ranks: '1-' is not a rank or rank range; {EXPECTED}"),
        ("0-2-4", f"--ranks: '0-2-4' is not a rank or rank range; {EXPECTED}"),
        ("+1", f"--ranks: '+1' is not a rank or rank range; {EXPECTED}"),
        ("²", f"--ranks: '²' is not a rank or rank range; {EXPECTED}"),
    ],
)
def test_parse_ranks_rejects_bad_parts_by_name(text, message):
    with pytest.raises(ValueError) as info:
        parse_ranks(text)
    assert str(info.value) == message
