"""Native execution's own pieces: regions that are stretches of a parent's forward
(`core.native.stretch`, `core.native.replay`) and where a stretch can begin or end
(`core.native.boundaries`)."""
