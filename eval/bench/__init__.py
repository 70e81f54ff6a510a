"""The benchmark harness behind `compress bench`: runs from a checkout of the repository (it reads the models
and text in `../shared/data`); not part of the installed package."""
