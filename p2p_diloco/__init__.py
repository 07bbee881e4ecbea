"""p2p_diloco: peer-to-peer Decoupled DiLoCo on hivemind.

Layers, each using only those below it: maths with no networking (``outer``, ``fragments``,
``schedule``), data and model (``data``, ``model``), the hivemind boundary (``transport``,
``records``), the island's two halves (``learner``, ``syncer``) and the roles (``island``,
``bootstrap``, ``status``) behind one CLI (``cli``).
"""

__version__ = "0.1.0"
