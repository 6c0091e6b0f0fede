"""Core: errors, typed config, logging, ids and clocks. Imports nothing else of miles."""
