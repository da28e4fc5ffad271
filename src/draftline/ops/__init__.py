"""Operating a run: salvage, remotes, node snapshots, planning."""
