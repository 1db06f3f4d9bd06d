"""Stop strings are cut even when split across pieces, and no part of one is ever emitted."""

from __future__ import annotations

from kvlink.serve.stop_strings import StopStringFilter


def _run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    cut = StopStringFilter(stops)
    text = "".join(cut.push(piece) for piece in pieces)
    return text + cut.flush(), cut.stopped


def test_stop_split_across_pieces_is_cut_before_it() -> None:
    assert _run(["END"], ["hello E", "N", "D and more"]) == ("hello ", True)


def test_held_prefix_is_released_when_it_turns_out_not_to_stop() -> None:
    cut = StopStringFilter(["END"])
    assert cut.push("an E") == "an "
    assert cut.push("ND") == ""
    assert cut.stopped

    cut = StopStringFilter(["END"])
    assert cut.push("an E") == "an "
    assert cut.push("Xtra") == "EXtra"
    assert cut.flush() == ""


def test_earliest_of_several_stops_wins_and_text_ends_there() -> None:
    assert _run(["cd", "b"], ["abcd"]) == ("a", True)
    assert _run(["zz"], ["no stop here z"]) == ("no stop here z", False)


def test_the_stop_string_that_ends_first_wins_as_in_vllm() -> None:
    assert _run(["abc", "b"], ["xabcd"]) == ("xa", True)
    assert _run(["abc", "bc"], ["xabcd"]) == ("x", True)  # both end at once: the one listed first
    assert _run(["bc", "abc"], ["xabcd"]) == ("xa", True)


def test_min_tokens_text_cannot_end_a_stop_string_but_one_may_begin_there() -> None:
    cut = StopStringFilter(["END", "x"])
    assert cut.push("an x E", protected=True) == "an x "  # "x" ends inside the protected text
    assert not cut.stopped
    assert cut.push("ND") == ""  # "END" begins in it and ends after it
    assert cut.stopped
    cut = StopStringFilter(["x"])
    assert cut.push("x", protected=True) + cut.push("x") == "x"
    assert cut.stopped
    assert _run(["END"], ["END"]) == ("", True)


def test_include_in_output_ends_the_text_with_the_stop_string() -> None:
    cut = StopStringFilter(["END", "b"], include_in_output=True)
    assert cut.push("an E") == "an "
    assert cut.push("ND more") == "END"
    assert cut.stopped and cut.flush() == ""
    assert StopStringFilter(["abc", "b"], include_in_output=True).push("xabcd") == "xab"
