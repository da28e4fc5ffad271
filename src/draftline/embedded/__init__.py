"""Builders of the embedded default: the tiny targets and the bundled prompt set."""
