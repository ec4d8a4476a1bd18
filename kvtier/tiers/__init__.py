"""Secondary tiers: the interface, the async lookup helper, and the tiers kvtier ships."""

from __future__ import annotations
