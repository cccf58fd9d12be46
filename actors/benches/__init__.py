"""The benchmarks that start the actor graph (`raytool bench load|pipeline|rollout|scale`); the
others, and the registry of every bench, are in raytool/bench."""
