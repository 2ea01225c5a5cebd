"""Data types: the fleet, the catalogs, a probed profile, a serve plan, the domain's fixed rules, bounded input reading."""
