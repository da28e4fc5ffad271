"""The quality checks, the Great Expectations suite that runs them, and its Data Docs."""
