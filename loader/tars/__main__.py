"""``python -m loader.tars``: runs :func:`loader.tars.main`."""

import sys

from . import main

sys.exit(main())
