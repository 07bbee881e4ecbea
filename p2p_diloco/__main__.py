from p2p_diloco.cli import run

run()
