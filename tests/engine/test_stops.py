"""StopMatcher: stop strings over streamed text pieces."""

from mlx_kvserve.engine.batch.stops import StopMatcher


def run(stops, pieces):
    """Feed every piece (stopping when a stop string completes); return (sent text, stopped)."""
    matcher = StopMatcher(tuple(stops))
    sent = []
    for piece in pieces:
        sent.append(matcher.feed(piece))
        if matcher.stopped:
            return "".join(sent), True
    sent.append(matcher.flush())
    return "".join(sent), False


def test_no_stops_passes_text_through():
    matcher = StopMatcher(())
    assert matcher.feed("hello") == "hello"
    assert matcher.flush() == ""
    assert not matcher.stopped


def test_stop_inside_one_piece():
    matcher = StopMatcher(("END",))
    assert matcher.feed("abcENDxyz") == "abc"
    assert matcher.stopped


def test_stop_split_across_pieces():
    matcher = StopMatcher(("END",))
    assert matcher.feed("hello E") == "hello "  # "E" might start the stop string: held back
    assert not matcher.stopped
    assert matcher.feed("N") == ""
    assert matcher.feed("D and more") == ""
    assert matcher.stopped


def test_split_stop_one_character_at_a_time():
    assert run(["<stop>"], list("abc<sto<stop>def")) == ("abc<sto", True)


def test_false_start_is_released():
    matcher = StopMatcher(("END",))
    assert matcher.feed("EN") == ""
    assert matcher.feed("X") == "ENX"  # no longer a prefix of the stop string
    assert not matcher.stopped


def test_held_back_partial_text_released_at_flush():
    matcher = StopMatcher(("END",))
    assert matcher.feed("the E") == "the "
    assert matcher.feed("N") == ""
    assert matcher.flush() == "EN"
    assert matcher.flush() == ""
    assert not matcher.stopped


def test_multiple_stops_earliest_wins():
    assert run(["world", "lo"], ["hello world"]) == ("hel", True)
    assert run(["world", "lo"], ["hel", "l", "o world"]) == ("hel", True)
    # A longer stop that starts earlier wins over a shorter one that ends earlier.
    assert run(["bcd", "d"], ["ab", "cd"]) == ("a", True)
    assert run(["d", "bcd"], ["abcd"]) == ("a", True)


def test_longest_partial_across_several_stops():
    matcher = StopMatcher(("xyz", "yzw"))
    assert matcher.feed("ayz") == "a"  # "yz" may start "yzw"
    assert matcher.feed("q") == "yzq"


def test_empty_stop_strings_are_ignored():
    assert run(["", "b"], ["aab"]) == ("aa", True)
    assert run([""], ["abc"]) == ("abc", False)


def test_stop_at_the_very_start():
    assert run(["ab"], ["a", "b", "c"]) == ("", True)


def test_no_stop_ever_completes():
    assert run(["STOP"], ["ST", "O", "X", "STO"]) == ("STOXSTO", False)
