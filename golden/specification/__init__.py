"""The specification, the bottom floor (NumPy only): what each variant is (``variants``), the
checks of its arguments (``validate``), positions and caches (``positions``), what the decoder
does to q and k besides RoPE (``decoder``), the exact arithmetic the fixtures are written in
(``exact``), the cases (``cases``), the fixture format and loader (``fixture``), the tolerance
table (``tolerances``), the contract of the core's named implementations
(``implementations``) and the weight layouts between frameworks (``mapping``). The float64
reference that computes the specification is its sibling, ``golden.reference``."""
