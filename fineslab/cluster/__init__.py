"""More than one node: the fleet on Ray (issue #21; docs/cluster.md).

Without a `cluster:` section (or `--ray`) only `serve.py` is imported (by the launcher's command
line) and Ray is not loaded: one machine stays the embedded default.

    plan.py       the placer over every node's devices; each node's share; residual placement
    driver.py     ClusterFleet: agents, the global placement, node fleets, the front router
    watch.py      node loss, exited or hung node fleets, re-placement, nodes that join
    nodes.py      the driver's table of nodes and node fleets; node router probes
    agent.py      NodeAgent: the Ray actor of one node, running its node fleets
    node.py       one node's share: the one-machine launcher, forked away from the agent
    front.py      the front router's routes and forwarding; front_app.py its HTTP app
    local.py      LocalCluster: several Ray nodes on one machine (tests, the CPU benchmark)
    serve.py      run_cluster: the cluster fleet run until a signal (`python -m fineslab.launch`)
"""
