"""`ultrafast evals`: whole jobs the ultrafast tier is sold for, timed end to end through the server.

- `humaneval.py`: best-of-N with execution (N candidates per problem in one request, run against the tests in
  `sandbox.py`, the first passing kept).
- `suite.py`: question sets run to completion per tier (wall-clock, tokens, the ledger's spend).
- `server_process.py`: the server an eval talks to (`--url`, or one started for the run).
"""
