"""Where rollflow's processes run: local subprocesses, or Ray actors placed by a placement plan.

- ``plan``: the placement plan (pure: no Ray, no torch).
- ``local``: ``LocalProcesses``, children of this process started together and never left behind (through
  ``rollflow.processes``); its kinds ``server_group`` (the engine servers: ``ServerGroup`` and their command
  lines) and ``router_process`` (the router rollflow starts for them).
- ``ray_cluster`` / ``ray_servers`` / ``ray_trainer``: the Ray backend (imported only with
  ``cluster.backend = "ray"``).

Nothing here imports Ray or torch at module scope.
"""
