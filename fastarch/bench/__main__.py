"""``python -m fastarch.bench ...`` is ``fastarch bench ...``."""

import sys

from .cli import main

sys.exit(main())
