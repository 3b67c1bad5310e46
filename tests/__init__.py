"""The test suite. A package, so that plain ``pytest`` and ``python -m pytest`` both import
``tests.helpers`` (pytest puts the repository root on sys.path for a package's modules)."""
