"""``python -m companion.bench <benchmark>``: see :mod:`companion.bench`."""

from . import main

main()
