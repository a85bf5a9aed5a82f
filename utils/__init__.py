"""Source checks of this repository that only its tests run (not installed with the package)."""
