"""One island (learner unit): data, model, the learner's inner loop, the syncer and its parts,
checkpoints, event log, experiment logging, progress reports and the island's assembly
(:mod:`.peer`). Uses :mod:`p2p_diloco.net` and :mod:`p2p_diloco.algo` below it (docs/DESIGN.md,
"Layers")."""
