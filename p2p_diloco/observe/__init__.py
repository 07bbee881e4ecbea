"""Observers of a swarm and the bootstrap node: ``status``, the web dashboard (page, JSON,
Prometheus) and its static files, all read from the islands' signed DHT records; no model, no GPU
(docs/DESIGN.md, "Layers")."""
