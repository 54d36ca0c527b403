"""Keys pressed on a phone's keypad (RFC 4733, SIP INFO, Twilio's `dtmf`, the native `dtmf` event),
gathered into the sequences a caller means: one ends on `#`, a pause, or `max_digits` keys.

A finished sequence becomes the user's turn as `keypad_text`: the keys spaced apart so the LM reads
"1 2 3" as three keys, not the number 123, and framed as keys so it does not take them for speech.
"""

from __future__ import annotations

from dataclasses import dataclass

KEYS = "0123456789*#ABCD"
TERMINATOR = "#"


def keypad_text(keys: str) -> str:
    return f"(keypad) The caller pressed {' '.join(keys)}."


@dataclass
class Keypad:
    """The sequence being pressed. The session calls `pause` once `pause_s` passed after a key."""

    max_digits: int
    keys: str = ""

    def press(self, key: str) -> str | None:
        """One key (one of KEYS). The finished sequence, if this key ends it: `#` ends it (a lone `#`
        is its own sequence: "pound" to confirm), so does the `max_digits`-th key."""
        if key == TERMINATOR:
            done, self.keys = self.keys or TERMINATOR, ""
            return done
        self.keys += key
        if len(self.keys) >= self.max_digits:
            return self.pause()
        return None

    def pause(self) -> str | None:
        """The caller stopped pressing: the sequence so far, if any."""
        done, self.keys = self.keys, ""
        return done or None
