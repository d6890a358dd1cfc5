"""Pinning pool memory for DMA through the CUDA driver: the ``Pinner`` the daemon injects.

Primitives:

- ``DriverPinner(driver)``: ``cuMemHostRegister`` (portable: every context sees the pages
  pinned) and ``cuMemHostUnregister``, in device 0's primary context. The host memory stays the
  pool's; ``core.memory.HostMemory`` chunks, rolls back and unregisters.
- ``default_pinner(driver_path)``: a ``DriverPinner`` where the CUDA driver loads and reports a
  device, else ``None`` (nothing attempts to pin on hosts without a GPU).
"""

from __future__ import annotations

from hicache.cuda_driver import CudaDriver, load_driver


class DriverPinner:
    def __init__(self, driver: CudaDriver) -> None:
        self._driver = driver

    def register(self, address: int, nbytes: int) -> None:
        with self._driver.context(0):
            self._driver.host_register(address, nbytes)

    def unregister(self, address: int) -> None:
        with self._driver.context(0):
            self._driver.host_unregister(address)


def default_pinner(driver_path: str | None = None) -> DriverPinner | None:
    """A CUDA driver pinner on hosts with a GPU; None on hosts without one."""
    driver = load_driver(driver_path)
    return DriverPinner(driver) if driver is not None else None
