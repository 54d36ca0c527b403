"""The engine's serving parts, behind `engine.stream.Engine` (the door callers use): the
conversations' caches and their pool (`caches`), what a request is and what it hands out
(`requests`), what a prompt token costs here (`cost`), who is admitted and who refused
(`admission`), the scheduler thread that batches every request's forwards (`scheduler`), and
the end-of-turn probes that run on a copy of a conversation's cache (`probes`)."""
