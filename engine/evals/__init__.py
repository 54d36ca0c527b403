"""Measuring the runtime: speed (`engine bench`) and what it says (`engine eval`)."""
