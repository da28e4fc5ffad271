"""Operating a run: salvage, remotes, node snapshots, stage inputs, planning."""
