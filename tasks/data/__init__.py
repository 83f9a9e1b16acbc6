"""The data stage: read the source, clean, dedup, split, check; the demo task; drift since the champion."""
