"""Support that tests, benchmarks and the demo use against real processes; never real data.

- ``faults``     named fault points: a test crashes a release at a precise place in a real process
                 (off unless ``DPOPS_FAULT`` names one; see the module for why production keeps the hooks).
- ``synthetic``  synthetic event data for benchmarks, tests and the demo.
"""
