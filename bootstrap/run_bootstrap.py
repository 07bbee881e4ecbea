#!/usr/bin/env python3
"""Thin entry point of the bootstrap role: same as `p2p-diloco bootstrap ...`."""
import sys

from p2p_diloco.cli import run

if __name__ == "__main__":
    run(["bootstrap", *sys.argv[1:]])
