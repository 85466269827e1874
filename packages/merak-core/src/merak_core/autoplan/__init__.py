"""Planning that runs on the ranks: ``layout: auto``, the plan check after the first steps, the TP
probe and the cluster planner's job-file reader.

The pure cost model and search are in :mod:`merak_core.planner` (which never imports this folder);
this folder may import every folder below it, including ``run`` (it times real steps).
"""
