#!/usr/bin/env python3
"""Thin entry point of the island role: same as `p2p-diloco peer ...` (e.g. --config peers/tiny_cpu.toml)."""
import sys

from p2p_diloco.cli import run

if __name__ == "__main__":
    run(["peer", *sys.argv[1:]])
