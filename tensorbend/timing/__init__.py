"""Hardware profiles and time models, below both clocks (offload/'s wall clock, simulate/'s event
time): what a transfer, a layer and a prediction cost on a named machine."""
