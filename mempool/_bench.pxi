# Compiled loops for the benchmarks (see bench/).
