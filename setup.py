"""Build the native parts; all other metadata lives in pyproject.toml.

- ``hicached.copy._copykernel``, the daemon's copy kernel: optional at run time (hicached falls
  back to a slow pure-Python executor and logs a warning);
- ``hicache._poll``, the fast path's poll-before-sleep wait (daemon and client): without it
  they sleep in ``recv`` at once;
- ``hicached.cache._shadows``, the reuse eviction policy's shadows: without it they run in
  Python, on the caller's thread, several times slower per sampled key;
- ``hicached.cache._queues``, the reuse eviction policy's queues and ghost: without them it
  keeps its keys in Python dictionaries, slower per key.

The build always tries all four and the test suite asserts they loaded. ``NATIVE`` is also read
(as a literal) by scripts/gpu/build_native.py, which builds the same modules without setuptools.
"""

NATIVE = [
    # (module, sources, headers, compile flags, link flags)
    ("hicached.copy._copykernel",
     ["daemon/hicached/copy/csrc/module.c", "daemon/hicached/copy/csrc/copykernel.c",
      "daemon/hicached/copy/csrc/cudasubmit.c", "daemon/hicached/copy/csrc/faultguard.c",
      "daemon/hicached/copy/csrc/pagescan.c"],
     ["daemon/hicached/copy/csrc/kernel.h"], ["-O3", "-pthread", "-std=c11"], ["-pthread"]),
    ("hicache._poll", ["clients/python/hicache/csrc/poll.c"], [],
     ["-O2", "-pthread", "-std=c11"], ["-pthread"]),
    ("hicached.cache._shadows", ["daemon/hicached/cache/csrc/shadows.c"],
     ["daemon/hicached/cache/csrc/hashing.h"],
     ["-O2", "-pthread", "-std=c11"], ["-pthread"]),
    ("hicached.cache._queues", ["daemon/hicached/cache/csrc/queues.c"],
     ["daemon/hicached/cache/csrc/hashing.h"], ["-O2", "-std=c11"], []),
]

if __name__ == "__main__":
    import atexit
    import shutil
    import tempfile

    from setuptools import Extension, setup

    # Intermediate files (build/, *.egg-info) go to a directory of this run's own, never into
    # the checkout: installing leaves `git status` as it was.
    scratch = tempfile.mkdtemp(prefix="hicached-build-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    setup(options={"build": {"build_base": scratch}, "egg_info": {"egg_base": scratch}},
          ext_modules=[
        Extension(name, sources=sources, depends=depends, extra_compile_args=cflags,
                  extra_link_args=ldflags, optional=True)
        for name, sources, depends, cflags, ldflags in NATIVE
    ])
