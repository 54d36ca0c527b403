"""The keypad's sequence rules (voice/conversation/keypad.py): `#`, a length, a pause end a sequence."""

from voice.conversation.keypad import Keypad, keypad_text


def test_hash_ends_a_sequence_without_itself():
    pad = Keypad(max_digits=16)
    assert [pad.press(k) for k in "123"] == [None, None, None]
    assert pad.press("#") == "123" and pad.keys == ""


def test_a_lone_hash_is_its_own_sequence():
    assert Keypad(max_digits=16).press("#") == "#"


def test_the_last_allowed_key_ends_a_sequence():
    pad = Keypad(max_digits=4)
    assert [pad.press(k) for k in "12*4"] == [None, None, None, "12*4"]
    assert pad.press("5") is None and pad.keys == "5"


def test_a_pause_ends_what_was_pressed_and_only_once():
    pad = Keypad(max_digits=16)
    pad.press("7")
    assert pad.pause() == "7"
    assert pad.pause() is None


def test_the_lm_reads_keys_one_by_one():
    assert keypad_text("123") == "(keypad) The caller pressed 1 2 3."
