"""The Ray layer: thin actors around raytool objects (this package), the drivers that compose and
run them (actors.drivers) and the benchmarks that measure them (actors.benches)."""
