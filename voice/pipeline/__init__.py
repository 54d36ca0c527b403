"""The speech pipeline's stages, each behind a small Protocol: where voice starts and ends (vad), what was said
(asr), whether the turn is over (endofturn), the reply's words (lm), its voice (tts), and the tools the LM may
call (tools).
"""
