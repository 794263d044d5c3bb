"""The benchmark suites (see README.md here). A package, so that its conftest and helpers
never shadow same-named modules of tests/ when both folders are collected in one run."""
