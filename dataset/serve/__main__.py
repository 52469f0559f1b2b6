"""`python -m distlearn.dataset.serve DIR`: see the package's text."""

import sys

from . import main

__all__: list[str] = []

sys.exit(main())
