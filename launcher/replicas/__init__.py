"""Replica groups: what happens across them, in two halves that never import each other.

The workers' half is a replica engine (`engine.py`'s `ReplicaEngine`), a part each strategy
holds (`Strategy.engine`): the quorum, the average across groups, the heal. The launcher's half
is the engine's coordinator: the servers and agents the groups need (torchft's Lighthouse, an
elastic agent per group). `registry.py`, torch-free, names both by module, as
`launcher.parallel.registry` names the strategies: `launch/` reaches a coordinator only
through it, and `parallel/build.py` an engine.
"""
