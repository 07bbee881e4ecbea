#!/usr/bin/env python3
"""E5: outer gradients in 32, 16, 8, 4 and 2 bits.

Streaming DiLoCo (arXiv 2501.18512, Sec. 3.4): 4-bit outer gradients match full precision; we add
2 bits as a negative control. Every arm keeps members bit-identical (wire.py) and keeps what it
could not send for the next round (error feedback).

Arms (2 islands, 1.5 x STEPS steps each): none (fp32), fp16, int8, int4, int2.

    .venv/bin/python scripts/experiments/e5_codecs.py [--steps 200]
"""

from _common import Arm, main


def build(steps: int):
    return [Arm(codec, 2, steps * 3 // 2, ["--outer-codec", codec]) for codec in ("none", "fp16", "int8", "int4", "int2")]


if __name__ == "__main__":
    raise SystemExit(main("e5", "E5: outer-gradient codecs", build, 200, __doc__))
