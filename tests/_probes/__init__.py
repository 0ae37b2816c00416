"""Modules the tests run as a run's ranks (a package, as the workbench's own rank modules are)."""
