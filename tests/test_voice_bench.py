"""`voice bench`'s figures: how the sessions sweep turns into "sessions held"."""

from voice.clients.bench import normalise, sessions_held


def sweep(*within: bool) -> list[dict]:
    return [{"sessions": n, "within_budget": ok} for n, ok in enumerate(within, start=1)]


def test_sessions_held_stops_at_the_first_n_over_budget():
    assert sessions_held(sweep(True, True, False, True)) == 2
    assert sessions_held(sweep(True, True, True)) == 3
    assert sessions_held(sweep(False, True)) == 0


def test_sessions_held_reads_the_sweep_in_order_of_n():
    entries = sweep(True, True, False)
    assert sessions_held(list(reversed(entries))) == 2


def test_normalise_spells_out_numbers_as_spoken():
    assert normalise("8 of spades, 4 of close.") == "eight of spades four of close"
