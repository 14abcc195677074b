"""Helpers for testing strata-rs: synthetic Hugging Face model folders."""

from strata_rs.testing.models import DTYPES, FAMILIES, PRESETS, make_model

__all__ = ["DTYPES", "FAMILIES", "PRESETS", "make_model"]
