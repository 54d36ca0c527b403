"""The voice service."""

import engine  # noqa: F401 - first: it sets how native thread pools wait, before numpy or torch loads
