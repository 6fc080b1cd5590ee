"""Run folders seen from outside: how a run ended (`outcome`, written by the launcher), and the
read-only views of `train runs` (a table of runs) and `train plot` (their curves).

Nothing here imports torch at module level: `train runs` answers in a fraction of a second.
"""
