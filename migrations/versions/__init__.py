"""Migration scripts, one per revision (a package so that setuptools installs them)."""
