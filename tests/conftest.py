"""Shared test settings: a hypothesis profile sized for a 2-core machine (no deadlines: machines are noisy)."""
from hypothesis import HealthCheck, settings

settings.register_profile("pipesched", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("pipesched")
