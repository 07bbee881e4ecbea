"""The lab, on top of everything and imported by nothing else: local swarms of real processes,
network namespaces, chaos runs with scheduled faults (and the faults injected into islands),
figures and plots, experiments, benchmarks and the baselines they compare against
(docs/DESIGN.md, "Layers")."""
