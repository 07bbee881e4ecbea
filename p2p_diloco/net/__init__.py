"""The hivemind boundary: everything that touches the network. Starting the DHT, identities and
addresses (:mod:`.dht`), the fragment channel over hivemind's averager (:mod:`.channel`), the codecs
that carry outer gradients (:mod:`.codec`) and the signed progress records (:mod:`.records`).
Uses :mod:`p2p_diloco.algo` below it, nothing above (docs/DESIGN.md, "Layers")."""
