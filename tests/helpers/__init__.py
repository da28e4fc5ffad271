"""Helpers of the tests: stand-ins (SGLang, S3), tiny models and data, fixture checks."""
