"""``python -m loader``: run the image pipeline over a dataset and print a summary."""

from loader.cli import main

raise SystemExit(main())
