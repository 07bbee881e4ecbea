"""The benchmark's arms, in the order of its tables (p2p_diloco.lab.benchmark runs them; a module of
its own so that the benchmark scripts check their flags before the lab's heavy imports)."""

ARMS = ("ddp", "hivemind", "torchft", "ours-sync", "ours")
