"""The storage libraries a URL's protocol needs (``fsspec``; ``s3fs`` for ``s3://``,
``huggingface_hub`` for ``hf://``), checked
against the oldest versions the loader's extras allow, from the installed packages' metadata
(nothing is imported). Runs in the trainer (before any worker starts), in the workers and in the
index command.
"""

from __future__ import annotations

from collections.abc import Iterable


class StorageLibraryError(ImportError):
    """A storage library that a URL's protocol needs (``fsspec``; ``s3fs`` for ``s3://``) is
    missing, or older than the loader's extras allow: named with the version found, the version
    needed and the command that installs it."""


#: The storage libraries each protocol needs and the oldest versions the extras allow
#: (pyproject's ``[s3]`` and ``[hub]`` extras); any other remote protocol needs fsspec.
STORAGE_LIBRARIES: dict[str, tuple[tuple[str, str], ...]] = {
    "s3": (("fsspec", "2023.6"), ("s3fs", "2023.6")),
    "s3a": (("fsspec", "2023.6"), ("s3fs", "2023.6")),
    "hf": (("fsspec", "2023.6"), ("huggingface_hub", "0.23")),
}
_FSSPEC_ONLY = (("fsspec", "2023.6"),)
#: What installs them.
INSTALL_STORAGE = 'pip install "dali-capture-loader[s3]"'
#: What installs them, for the protocols that another extra serves.
INSTALL_BY_PROTOCOL = {"hf": 'pip install "dali-capture-loader[hub]"'}


def _version_key(version: str) -> tuple[int, ...]:
    """The leading numbers of a version (``2023.6.0`` -> (2023, 6, 0); ``0.4.2.post1`` ->
    (0, 4, 2)): enough to compare with the extras' floors."""
    numbers = []
    for part in version.split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(numbers)


def storage_library_problem(protocol: str) -> str | None:
    """What is wrong with the storage libraries ``protocol`` needs (read from the installed
    packages' metadata, as the import would find them: nothing is imported), or None."""
    from importlib import metadata
    from importlib.util import find_spec

    if protocol in ("", "file", "local"):
        return None
    install = INSTALL_BY_PROTOCOL.get(protocol, INSTALL_STORAGE)
    for package, needed in STORAGE_LIBRARIES.get(protocol, _FSSPEC_ONLY):
        try:
            found = metadata.version(package)
        except metadata.PackageNotFoundError:
            found = None
        if found is None and find_spec(package) is None:
            return (
                f"reading {protocol}:// URLs needs {package}>={needed}, which is not installed: "
                f"{install}"
            )
        if found is not None and _version_key(found) < _version_key(needed):
            return (
                f"reading {protocol}:// URLs needs {package}>={needed}; {package} {found} is "
                f"installed (older than the loader's extras allow): {install}"
            )
    return None


def check_storage_libraries(urls: Iterable[str]) -> None:
    """:class:`StorageLibraryError` when a library that one of ``urls``' protocols needs is
    missing or too old (the first such protocol's; see :func:`storage_library_problem`)."""
    for protocol in url_protocols(urls):
        problem = storage_library_problem(protocol)
        if problem is not None:
            raise StorageLibraryError(problem)


def url_protocols(urls: Iterable[str]) -> list[str]:
    """The protocol of each URL among ``urls`` (``s3`` of ``s3://...``; local paths and
    ``file://`` left out), in order, once."""
    return list(dict.fromkeys(url.split("://", 1)[0] for url in urls if _is_url(url)))


def _is_url(path: str) -> bool:
    """A URL (``proto://...``), not a local path (as :func:`~._storage.is_url` says)."""
    return "://" in path and not path.startswith("file://")
