"""Build the native copy kernel; all other metadata lives in pyproject.toml.

The kernel is optional at run time (hicached falls back to a slow pure-Python executor and logs a
warning), but the build always tries it and the test suite asserts it loaded.
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
        )
    ]
)
