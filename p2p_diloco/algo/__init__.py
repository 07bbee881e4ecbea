"""Pure maths, no networking: pseudo-gradients, outer steps and merges (:mod:`.outer`), the fragment
layout (:mod:`.fragments`), the swarm-wide round clock (:mod:`.schedule`), low-bit grids and their
lossless wire formats (:mod:`.grid`), and what the learner and the syncer hand each other
(:mod:`.handoff`). Imports nothing from the layers above (docs/DESIGN.md, "Layers")."""
