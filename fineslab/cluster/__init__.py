"""More than one node: the fleet on Ray (issue #21; in progress).

Without a `cluster:` section nothing here is imported and Ray is not loaded: one machine stays
the embedded default.

    local.py   LocalCluster: several Ray nodes on one machine (tests, the CPU benchmark)
    agent.py   NodeAgent: the Ray actor of one node, owner of that node's arenas
"""
