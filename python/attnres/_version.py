# The one place the attnres version is written. Read by
#   - pyproject.toml: [tool.setuptools.dynamic] version = {attr = "attnres._version.__version__"}
#     (setuptools parses this file, it does not import the package),
#   - python/attnres/__init__.py: attnres.__version__,
#   - CMakeLists.txt: file(STRINGS ... REGEX "^__version__") for project(VERSION).
# Keep it to this one line of the form __version__ = "X.Y.Z".
__version__ = "0.1.0"
