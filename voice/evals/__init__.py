"""Evaluation programs run from the command line (`voice eot-eval`, `voice room-eval`, `voice spoken-eval`): what
a change does to turn-taking and answers, measured.
"""
