"""Entry point for Bazel py_test targets: runs pytest on the test file given as argument."""

import sys

import pytest

if __name__ == "__main__":
  sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
