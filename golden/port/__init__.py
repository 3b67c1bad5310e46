"""Tools for a user's own port: the twin training loops and optimizer pairings (``training``)
and the pytest helpers (``testing``). ``golden.compare`` (a port run beside its original, step
by step) and ``golden.examples`` are siblings at their public paths; the converters are
``golden.convert``."""
