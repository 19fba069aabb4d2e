"""Offline stand-in for @rules_java//java:defs.bzl: forwards to Bazel's native rules.

Bazel 4.2 parses @bazel_tools//tools/jdk (registered toolchains) even for C++-only
builds, and that package loads from @rules_java. Use with
  --override_repository=rules_java=$PWD/custom_calls/cpu/bazel/rules_java
"""

def java_binary(**kwargs):
    native.java_binary(**kwargs)

def java_import(**kwargs):
    native.java_import(**kwargs)

def java_library(**kwargs):
    native.java_library(**kwargs)

def java_runtime(**kwargs):
    native.java_runtime(**kwargs)

def java_toolchain(**kwargs):
    native.java_toolchain(**kwargs)
