"""Build the native parts; all other metadata lives in pyproject.toml.

- ``hicached.copy._copykernel``, the daemon's copy kernel: optional at run time (hicached falls
  back to a slow pure-Python executor and logs a warning);
- ``hicache._poll``, the fast path's poll-before-sleep wait (daemon and client): without it
  they sleep in ``recv`` at once.

The build always tries both and the test suite asserts they loaded.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hicached.copy._copykernel",
            sources=[f"daemon/hicached/copy/csrc/{name}.c"
                     for name in ("module", "copykernel", "cudasubmit", "faultguard",
                                      "pagescan")],
            depends=["daemon/hicached/copy/csrc/kernel.h"],
            extra_compile_args=["-O3", "-pthread", "-std=c11"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "hicache._poll",
            sources=["clients/python/hicache/csrc/poll.c"],
            extra_compile_args=["-O2", "-pthread", "-std=c11"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
    ]
)
