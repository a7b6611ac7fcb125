"""Plain files as samples: a list of paths or an ImageFolder (listed once per cache directory
and kept as an index file that workers map), read whole, and the image-size guard that every
format applies to encoded images. Runs in the worker.

* ``_files``: :func:`list_files`, the file tables and :class:`FileLoader`, :func:`open_files`;
* ``_folder_index``: an ImageFolder's index file (kept in the node's cache directory,
  :mod:`workers.sources.storage`);
* ``_image_size``: an encoded image's size read from its header, and the pixel limit.

May import: the standard library, numpy, :mod:`workers.sources.plan` and
:mod:`workers.sources.storage`. Nothing of :mod:`workers.sources.tars`, which imports this.
"""

from ._files import FileLoader, ListedFiles, list_files, open_files, read_file
from ._image_size import (
    MAX_IMAGE_PIXELS,
    ImageSize,
    ImageTooLargeError,
    checked_limit,
    image_size,
    over_limit,
)

__all__ = [
    "MAX_IMAGE_PIXELS",
    "FileLoader",
    "ImageSize",
    "ImageTooLargeError",
    "ListedFiles",
    "checked_limit",
    "image_size",
    "list_files",
    "open_files",
    "over_limit",
    "read_file",
]
