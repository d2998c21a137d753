"""The operator's I/O, one module per outside thing: the Kubernetes API (``kube``), the
watch-fed caches, checkpoints in storage (``sources``), Events, Prometheus metrics,
certificate files and the agent's HTTP port (``agentprobe``). Adapters never import each
other; the behaviours combine them."""
