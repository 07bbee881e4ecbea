"""p2p_diloco: peer-to-peer Decoupled DiLoCo on hivemind.

Layers, each importing only those below it (docs/DESIGN.md, "Layers"; checked by import-linter):
``errors``, ``flags``, ``config``, ``procs``, ``files``; ``algo`` (pure maths); ``net`` (the hivemind
boundary); ``island`` (one learner unit: learner, syncer parts, checkpoints, reports); ``observe``
(bootstrap node, status, dashboard); ``cli``; and the ``lab`` on top, imported by nothing else.
"""

import os as _os

# hivemind hands tensors between its processes through torch's shared memory. Its default, the
# "file_system" strategy, runs a torch_shm_manager process whose client state is inherited across
# fork and broke ("terminate called ... Broken pipe") when averagers passed downloaded state back;
# file descriptors passed over Unix sockets need no manager. Must be set before hivemind is imported.
_os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

__version__ = "0.1.0"
