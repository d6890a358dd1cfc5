from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

pytest_plugins = ["tests.cuda_fixtures"]

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev", max_examples=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    from tests.reliability.figures import FIGURES

    if not FIGURES:
        return
    terminalreporter.section("reliability figures")
    for test, values in sorted(FIGURES.items()):
        shown = ", ".join(f"{k}={v:,.0f}" if float(v).is_integer() else f"{k}={v:,.2f}"
                          for k, v in values.items())
        terminalreporter.write_line(f"{test}: {shown}")
