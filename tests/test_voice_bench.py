"""`voice bench`'s figures: how the sessions sweep turns into "sessions held", and what a listener hears."""

import pytest

from voice.clients.bench import Player, normalise, sessions_held


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


def test_player_counts_silence_only_when_the_next_audio_comes_after_the_last_has_played():
    player = Player()
    player.play(10.0, 1.0)  # waiting for the first audio is voice-to-voice, not a gap
    player.play(10.5, 1.0)  # queued behind the first: plays 11.0-12.0
    player.play(11.9, 0.5)  # still in time: 12.0-12.5
    assert player.gap_s == 0
    player.play(13.0, 0.2)  # 0.5 s of silence first
    player.play(14.0, 0.2)  # and 0.8 s more
    assert player.gap_s == pytest.approx(1.3)

