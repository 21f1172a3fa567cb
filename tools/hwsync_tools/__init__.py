"""hwsync's tooling, a distribution of its own (hwsync-tools): the multi-host test bed (bed/), the benchmarks behind
`hwsync bench ...` (bench/, with the verl peer's shim). `import hwsync` imports none of it."""
