"""Builds overcast's native core (overcast/native) with the package: `pip install -e .`.

OVERCAST_NATIVE_DEBUG=1 builds it without optimisation and with assertions;
OVERCAST_NATIVE_SANITIZE=1 with AddressSanitizer and UndefinedBehaviorSanitizer (the Python
that loads it then needs libasan preloaded; tests/native builds the core's own test programs
with the sanitizers instead).
"""

import glob
import os

from setuptools import Extension, setup

# The core's parts, listed once by folder (overcast/native/parts.txt: common, rank, aggregator;
# read by every builder), and the Python binding (overcast/native/binding): module.c and a
# bind_*.c per type. Includes name their folder from overcast/native ("common/wire.h").
with open("overcast/native/parts.txt") as f:
    PARTS = [f"overcast/native/{name}.c" for name in f.read().split()]
BINDING = ["overcast/native/binding/module.c",
           *sorted(glob.glob("overcast/native/binding/bind_*.c"))]
flags = ["-std=c11", "-Wall", "-Wextra", "-Wshadow", "-fno-strict-aliasing",
         "-Werror=implicit-function-declaration", "-Werror=int-conversion"]
link = []
if os.environ.get("OVERCAST_NATIVE_DEBUG"):
    flags += ["-O0", "-g", "-UNDEBUG"]
else:
    flags += ["-O3"]
if os.environ.get("OVERCAST_NATIVE_SANITIZE"):
    flags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    link += ["-fsanitize=address,undefined"]

setup(ext_modules=[Extension("overcast.native._core",
                             sources=PARTS + BINDING, include_dirs=["overcast/native"],
                             libraries=["crypto"], extra_compile_args=flags,
                             extra_link_args=link)])
