"""Infrastructure both packages use (engine serve and the voice service): bounded JSON on the wire, log
redaction, API keys, model files shipped in PyPI pieces. It imports nothing else of ours."""
