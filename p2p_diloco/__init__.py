"""p2p_diloco: peer-to-peer Decoupled DiLoCo on hivemind.

Layers, each using only those below it: maths with no networking (``outer``, ``fragments``,
``schedule``), data and model (``data``, ``model``), the hivemind boundary (``transport``,
``records``), the island's two halves (``learner``, ``syncer``) and the roles (``island``,
``bootstrap``, ``status``) behind one CLI (``cli``).
"""

import os as _os

# hivemind hands tensors between its processes through torch's shared memory. Its default, the
# "file_system" strategy, runs a torch_shm_manager process whose client state is inherited across
# fork and broke ("terminate called ... Broken pipe") when averagers passed downloaded state back;
# file descriptors passed over Unix sockets need no manager. Must be set before hivemind is imported.
_os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

__version__ = "0.1.0"
