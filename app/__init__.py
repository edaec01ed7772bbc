"""Remat Studio's Dash app: presentation and caching over `core` (no planning logic here)."""
