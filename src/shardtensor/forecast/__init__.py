"""Forecast a training step at any scale from one process: the collectives one rank issues per mesh dim,
their modeled time on a hardware profile, and its peak memory by role (docs/forecast.md).

    python -m shardtensor.forecast my_package.my_module:make_step 8x8x16 --names replicate,dp,tp
"""

from .core import CollectiveForecast, Forecast, forecast, link_class, price
from .memory import CATEGORIES, LiveBytes
from .profiles import PROFILES, HardwareProfile, calibrated_profile, profile_named

__all__ = [
    "forecast", "Forecast", "CollectiveForecast", "link_class", "price", "LiveBytes", "CATEGORIES",
    "PROFILES", "HardwareProfile", "calibrated_profile", "profile_named",
]
