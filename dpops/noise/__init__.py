"""The noise layer: where a release's randomness comes from and how it is calibrated and drawn.

Read it bottom-up; each module imports only the ones above it in this list:

- ``randomness``   where noise comes from: the keyed production modes and the seeded test mode
                   (semantics.md sections 2-3). Nothing else in dpops draws random bits.
- ``samplers``     exact integer samplers (discrete Laplace, discrete Gaussian) driven only by uniform
                   random integers, so no floating-point attack reaches the output.
- ``sensitivity``  L0/Linf/L1/L2 sensitivities derived from the declared, public contribution bounds
                   (semantics.md section 1); the one owner of every sensitivity formula.
- ``calibration``  from a privacy target and a sensitivity to a noise scale.
- ``mechanisms``   the calibrated additive-noise mechanisms the Beam pipeline calls per aggregate.
- ``selection``    private selection: exponential mechanism, top-k, quantiles, partition selection.

Import the module you need (``from dpops.noise import mechanisms``); this package re-exports nothing, so
``import dpops.noise`` stays cheap for the planner and the CLI.
"""
