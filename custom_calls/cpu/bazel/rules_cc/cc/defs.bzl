"""Offline stand-in for @rules_cc//cc:defs.bzl: forwards to Bazel's native C++ rules.

Bazel 4.2's generated @local_config_cc loads cc_toolchain & co. from @rules_cc,
which Bazel would otherwise download. Use with
  --override_repository=rules_cc=$PWD/custom_calls/cpu/bazel/rules_cc
"""

def cc_binary(**kwargs):
    native.cc_binary(**kwargs)

def cc_library(**kwargs):
    native.cc_library(**kwargs)

def cc_test(**kwargs):
    native.cc_test(**kwargs)

def cc_proto_library(**kwargs):
    native.cc_proto_library(**kwargs)

def cc_toolchain(**kwargs):
    native.cc_toolchain(**kwargs)

def cc_toolchain_suite(**kwargs):
    native.cc_toolchain_suite(**kwargs)

def objc_library(**kwargs):
    native.objc_library(**kwargs)
