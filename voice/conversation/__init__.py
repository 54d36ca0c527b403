"""One conversation, as its Session runs it: the user's turn (turns), the reply and who holds the floor (reply),
Wyoming's programs (oneshot), what was said (history), what goes out (outbox, playback), keypresses (keypad), a
phone call's own tools (calltools: end and transfer), the latency budget (latency), the call log (calllog) and
faults injected for tests (faults).
"""
